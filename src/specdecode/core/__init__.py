"""The algorithm, with no models: sampling, the accept/reject rule, stopping, adaptive k, stats."""
