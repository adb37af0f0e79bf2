"""Helpers shared by the test files: tiny models built from configs (fast, deterministic,
offline), transformers' greedy reference, and the exact distributions and G-test of the
sampling tests."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import re
import socket
import threading
import time

import numpy as np
import torch
import uvicorn
from scipy.stats import power_divergence
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode.server.faults import WorkerCrash

VOCAB = 24
WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]


# the shape every tiny Llama-family model shares: fast, and big enough for GQA and rope
TINY_SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_causal_lm(model_class, config_class, seed: int, **config):
    """A randomly initialised model of TINY_SHAPE (config overrides it), in eval mode."""
    torch.manual_seed(seed)
    return model_class(config_class(**(dict(vocab_size=VOCAB) | TINY_SHAPE | config))).eval()


def tiny_llama(seed: int, vocab_size: int = VOCAB, max_positions: int = 128, init: float = 0.6) -> LlamaForCausalLM:
    return tiny_causal_lm(
        LlamaForCausalLM,
        LlamaConfig,
        seed,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        initializer_range=init,  # large weights give peaked, dissimilar distributions
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


def head64_llama(
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    vocab_size: int = 256,
    kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    **config,
) -> LlamaForCausalLM:
    """hidden 256, head_dim 64: the default model's head size (which the fast runner's tree
    attention kernel takes), with no special tokens, so nothing ends a generation early."""
    torch.manual_seed(seed)
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4)
    special = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    llama = LlamaConfig(
        vocab_size=vocab_size,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        **(shape | special | config),
    )
    return LlamaForCausalLM(llama).eval().to(dtype)


def tiny_gpt2(seed: int, vocab_size: int = VOCAB, max_positions: int = 128, init: float = 0.6) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=max_positions,
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over 'w0 w1 ...', so text prompts work offline."""
    words = WORDS[:2] + [f"w{i}" for i in range(vocab_size - 2)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def nearby_draft(target, noise: float, seed: int = 0):
    """A copy of target whose output head is perturbed: a draft that agrees often, not always."""
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed)
    head = draft.get_output_embeddings().weight
    with torch.no_grad():
        head.add_(torch.randn(head.shape, generator=generator) * head.std() * noise)
    return draft


def permuted_vocabulary(model, seed: int = 0):
    """The same model and words under another tokenizer: ids permuted, embeddings and head rows too.

    Drafting for `model` through text, it proposes exactly what model would: a cross-tokenizer
    drafter with perfect agreement, built offline."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))  # old id -> new id
    words = WORDS[:2] + [f"w{i}" for i in range(vocab_size - 2)]
    backend = Tokenizer(models.WordLevel({w: int(perm[i]) for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    permuted = copy.deepcopy(model)
    with torch.no_grad():
        for weight in (permuted.get_input_embeddings().weight, permuted.get_output_embeddings().weight):
            weight[perm] = weight.clone()
    return permuted, tokenizer


GREEDY_PROMPTS = [[3, 5, 7, 2], [1, 1, 4, 9, 16, 9, 4], [20, 3, 20, 3, 20]]  # token ids, for the greedy tests


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def assert_drafted_and_accepted(results, name=None):
    """Equality proves nothing about speculation unless drafts were verified and some kept."""
    assert sum(r.stats.drafted_tokens for r in results) > 0, name
    assert sum(r.stats.accepted_tokens for r in results) > 0, name


def adapting_on_acceptance(engine, monkeypatch) -> list[int]:
    """Make the engine's adaptive k follow acceptance alone, whatever the machine's speed:
    verification costs frozen at synthetic values that rise steeply past 3 tokens, drafting
    at 2 ms a token. Returns the list that collects every k the policy chooses, so that a
    test can check that k really adapted."""
    from specdecode.core.adaptive import AdaptiveK

    engine.decoder.costs.seconds = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.030, 5: 0.032, 6: 0.034}
    monkeypatch.setattr(engine.decoder.costs, "record", lambda n, seconds: None)
    monkeypatch.setattr(
        AdaptiveK, "record_draft", lambda self, n, seconds: setattr(self, "draft_seconds_per_token", 0.002)
    )
    chosen: list[int] = []
    choose = AdaptiveK.choose

    def spy(self, k_max, batch_size=1):
        chosen.append(choose(self, k_max, batch_size))
        return chosen[-1]

    monkeypatch.setattr(AdaptiveK, "choose", spy)
    return chosen


# --- sampling: the target's exact law and the G-test (test_distribution.py, test_batching.py) ---

ALPHA = 0.001
DIST_VOCAB = 12  # vocabulary of the sampling tests' models: small enough to enumerate
PROMPT = [3, 5, 7, 2]
SKIP = 1  # new tokens before the tested window: the first comes from the prefill, undrafted
NUM_TOKENS = 2  # length of the window whose joint distribution is tested
SAMPLES = 2000


def reference_probs(logits: np.ndarray, temperature: float, top_k=None, top_p=None) -> np.ndarray:
    """Target distribution in float64, written independently of specdecode.core.sampling."""
    z = logits.astype(np.float64) / temperature
    if top_k is not None:
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        p[order[mass_before >= top_p]] = 0.0
        p /= p.sum()
    return p


def exact_joint(model, params) -> np.ndarray:
    """P(new tokens SKIP .. SKIP + NUM_TOKENS - 1 = t) for every t, flattened [DIST_VOCAB ** NUM_TOKENS]."""
    model64 = model.to(torch.float64)
    length = SKIP + NUM_TOKENS
    conditional = {}
    for prefix in itertools.chain.from_iterable(itertools.product(range(DIST_VOCAB), repeat=n) for n in range(length)):
        with torch.no_grad():
            logits = model64(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].numpy()
        conditional[prefix] = reference_probs(logits, **params)
    model.to(torch.float32)
    probs = np.ones([DIST_VOCAB] * length)
    for t in itertools.product(range(DIST_VOCAB), repeat=length):
        for n in range(length):
            probs[t] *= conditional[t[:n]][t[n]]
    return probs.sum(axis=tuple(range(SKIP))).reshape(-1)  # the skipped tokens summed out


def sample_counts(engine, k, params, seed) -> np.ndarray:
    # room for a whole first speculative step: k drafts and a bonus token after the skipped ones
    results = engine.generate([PROMPT] * SAMPLES, max_new_tokens=SKIP + max(k + 1, NUM_TOKENS), seed=seed, **params)
    counts = np.zeros(DIST_VOCAB**NUM_TOKENS)
    for r in results:
        counts[np.ravel_multi_index(r.token_ids[SKIP : SKIP + NUM_TOKENS], [DIST_VOCAB] * NUM_TOKENS)] += 1
    return counts


def g_test_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """G-test of counts against probs, pooling cells expected fewer than 5 times."""
    if counts[probs == 0].sum() > 0:
        return 0.0  # a sample the distribution cannot produce
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    observed = np.append(counts[~small & (probs > 0)], counts[small].sum())
    expected = np.append(expected[~small & (probs > 0)], expected[small].sum())
    if expected[-1] < 5:  # pool the leftovers into the smallest regular cell
        smallest = np.argmin(expected[:-1])
        observed[smallest] += observed[-1]
        expected[smallest] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    assert len(expected) >= 2, "too few cells for a G-test: spread the distribution out"
    return power_divergence(observed, expected, lambda_="log-likelihood").pvalue


INIT = {tiny_llama: 0.3, tiny_gpt2: 0.2}  # weight scales that give spread-out distributions


def target_and_draft(family):
    target = family(seed=1, vocab_size=DIST_VOCAB, init=INIT[family])
    return target, nearby_draft(target, noise=0.5)  # accepts about 70% of the time


# --- the server, run for real on loopback (test_server.py, test_server_faults.py, test_loadtest.py) ---

SERVED_MODEL = "tiny"
SERVER_PROMPT = "w1 w2 w3 w1 w2"


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn in a thread on a free port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        threading.Event().wait(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        deadline.wait(0.02)
    raise AssertionError("condition not reached in time")


class Gate:
    """A step hook that lets `open_steps` steps through, then holds every step until opened;
    `delay` slows each step down."""

    def __init__(self, open_steps: int = 0, delay: float = 0.0):
        self.open_steps, self.delay = open_steps, delay
        self.opened = threading.Event()
        self.steps = 0

    def before_step(self, requests) -> None:
        self.steps += 1
        if self.steps > self.open_steps:
            self.opened.wait(30)
        time.sleep(self.delay)

    def after_forward(self, requests) -> None:
        pass


class CrashAt:
    """A step hook that crashes the engine worker at the given step numbers."""

    def __init__(self, *steps: int):
        self.crash_steps, self.steps = set(steps), 0

    def before_step(self, requests) -> None:
        self.steps += 1
        if self.steps in self.crash_steps:
            raise WorkerCrash(f"injected crash at step {self.steps}")

    def after_forward(self, requests) -> None:
        pass


# --- real services on loopback (Redis), started and stopped by the tests ---


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def redis_server(port: int | None = None):
    """A real redis-server on a free loopback port, nothing saved to disk; yields its URL.
    Missing binary: a failure under CI (the project's setup installs it), a skip elsewhere."""
    import shutil
    import subprocess

    import pytest

    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (make setup installs Debian's redis-server as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = port or free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=0.5)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def prometheus_server(targets: list[str], tmp_path, scrape_interval: str = "1s"):
    """A real Prometheus on a free loopback port scraping `targets` ("host:port", their
    /metrics) every scrape_interval, its storage in tmp_path; yields its URL once it is ready.
    Missing binary: a failure under CI (the project's setup installs it), a skip elsewhere."""
    import shutil
    import subprocess

    import httpx
    import pytest

    binary = shutil.which("prometheus")
    if binary is None:
        message = "prometheus is not installed (make setup installs Debian's prometheus as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n  - job_name: specdecode\n"
        f"    scrape_interval: {scrape_interval}\n    scrape_timeout: {scrape_interval}\n"
        f"    static_configs:\n      - targets: [{', '.join(repr(t) for t in targets)}]\n"
    )
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - written while it runs, closed below
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(500):
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("prometheus did not become ready")
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def bnb_llama(seed: int, vocab_size: int = VOCAB, init: float = 0.3) -> LlamaForCausalLM:
    """A tiny Llama that bitsandbytes can quantize: its CPU 4-bit layout needs every output size
    a multiple of 32 (tiny_llama's key/value projections have 16 outputs)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def healthy(url: str) -> bool:
    """Whether a server at url (http://HOST:PORT) answers /health with 200 yet."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
