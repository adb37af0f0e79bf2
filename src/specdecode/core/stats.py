"""What one generation did: how much was drafted, accepted, and how fast it ran.

A step verifies a chain or a tree (drafters/base.py). drafted_tokens counts a tree's nodes and
accepted_tokens its accepted depth (the nodes of its accepted path): both still count draft
tokens. Per-position counters count a tree's nodes by depth: position i (0 = first) is depth
i + 1; drafted counts the nodes at that depth (so they still sum to drafted_tokens), accepted
counts the step if its accepted path reaches that depth. The tree_* fields count tree steps alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    drafter: str  # which drafter ran ("none" for target-only decoding)
    num_speculative_tokens: int  # k, the most tokens drafted per step
    k_policy: str = "fixed"  # "fixed": k every step; "adaptive": k chosen from measurements (adaptive.py)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [k] steps that drafted position i
    accepted_per_position: list[int] = field(default_factory=list)  # [k] steps that accepted position i
    drafted_histogram: dict[int, int] = field(default_factory=dict)  # draft length -> steps (the k used)
    drafted_by_source: dict[str, list[int]] = field(default_factory=dict)  # auto's candidate -> [drafted, accepted]
    tree_steps: int = 0  # steps that verified a tree (not a chain)
    tree_nodes: int = 0  # nodes those trees held
    tree_accepted_depth: int = 0  # accepted depths of those steps, summed
    tree_histogram: dict[int, int] = field(default_factory=dict)  # tree size (nodes) -> steps
    wall_time_s: float = 0.0
    cached: bool = False  # answered from the response cache, without a forward
    target_precision: str | None = None  # the target's weights: "float32", "nf4 (bitsandbytes, ...)" (engine.py)
    target_runner: str | None = None  # which runner ran the target, in words (runners.select.runner_label)
    # tokens the target ran again because its cache had lost them (after an engine crash, or a
    # failed forward its runner could not undo); they emit nothing new (decoder.py, "rebuild")
    replayed_tokens: int = 0
    # leading prompt tokens found in the cache a slot kept from an earlier sequence, not run
    # again (runners/slots.py, "prefix reuse"); the OpenAI usage's cached_tokens
    prompt_tokens_reused: int = 0
    # tokens a grammar forced (structured outputs), drafted ahead of any drafter's at no cost and
    # verified like any draft; counted here, not in drafted_tokens and accepted_tokens
    forced_tokens: int = 0
    forced_accepted: int = 0
    note: str | None = None  # why this generation ran other than asked (a target that cannot speculate)

    def __post_init__(self) -> None:
        self.drafted_per_position = self.drafted_per_position or [0] * self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def record_step(
        self, num_drafted: int, num_accepted: int, source: str | None = None, depths: list[int] | None = None
    ) -> None:
        """One verification step: num_drafted tokens (a tree's nodes), num_accepted of them (its
        accepted depth); depths: each node's depth (1 = a child of the root), None for a chain."""
        self.target_forwards += 1
        self.drafted_histogram[num_drafted] = self.drafted_histogram.get(num_drafted, 0) + 1
        if source is not None:
            counts = self.drafted_by_source.setdefault(source, [0, 0])
            counts[0] += num_drafted
            counts[1] += num_accepted
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if depths is not None:
            self.tree_steps += 1
            self.tree_nodes += num_drafted
            self.tree_accepted_depth += num_accepted
            self.tree_histogram[num_drafted] = self.tree_histogram.get(num_drafted, 0) + 1
        for position in range(num_drafted) if depths is None else [d - 1 for d in depths]:
            self.drafted_per_position[position] += 1
        for position in range(num_drafted if depths is None else max(depths, default=0)):
            self.accepted_per_position[position] += position < num_accepted

    def record_forced(self, num_forced: int, num_accepted: int) -> None:
        self.forced_tokens += num_forced
        self.forced_accepted += num_accepted

    def record_replay(self, num_tokens: int, forward: bool = False) -> None:
        """num_tokens run again to rebuild a lost cache; forward: in a forward of their own."""
        self.replayed_tokens += num_tokens
        self.target_forwards += forward

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, the bonus/recovered token included (as Spec-Bench counts)."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_k(self) -> float:
        """Draft tokens per step, the steps that drafted nothing included."""
        return self.drafted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Nodes per tree step."""
        return self.tree_nodes / self.tree_steps if self.tree_steps else 0.0

    @property
    def mean_accepted_depth(self) -> float:
        """Accepted depth per tree step (its tokens per forward are one more)."""
        return self.tree_accepted_depth / self.tree_steps if self.tree_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_k": self.mean_k,
            "mean_tree_size": self.mean_tree_size,
            "mean_accepted_depth": self.mean_accepted_depth,
            "tokens_per_second": self.tokens_per_second,
        }

    def summary(self) -> str:
        return (
            f"{self.generated_tokens} tokens in {self.wall_time_s:.2f} s ({self.tokens_per_second:.1f} tok/s) | "
            f"drafter {self.drafter}, {self.k_policy} k<={self.num_speculative_tokens} (mean {self.mean_k:.1f}, "
            f"histogram {dict(sorted(self.drafted_histogram.items()))}) | "
            f"acceptance {self.acceptance_rate:.0%} ({self.accepted_tokens}/{self.drafted_tokens}) | "
            f"{self.mean_accepted_length:.2f} tokens per target forward ({self.target_forwards} forwards)"
            + (
                f" | {self.tree_steps} tree steps (mean {self.mean_tree_size:.1f} nodes, accepted depth "
                f"{self.mean_accepted_depth:.2f}, sizes {dict(sorted(self.tree_histogram.items()))})"
                if self.tree_steps
                else ""
            )
            + (f" | target {self.target_precision}" if self.target_precision else "")
            + (f" on {self.target_runner}" if self.target_runner else "")
            + (f" | {self.forced_accepted}/{self.forced_tokens} grammar-forced tokens" if self.forced_tokens else "")
            + (f" | {self.replayed_tokens} tokens replayed" if self.replayed_tokens else "")
            + (f" | note: {self.note}" if self.note else "")
        )
