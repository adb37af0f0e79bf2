"""The tree attention kernel and tree verification on the fast Llama runner: a query's output
is a function of the keys it sees, alone or among others, contiguous or at other cache slots;
every node of a tree gets bitwise the logits of decoding its path alone; keep() moves the
accepted path so that decoding goes on as if it had been decoded alone; batches of ragged
trees; and without the kernel, the runner says so and chains stay exact.
"""

import logging
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import head64_llama, tiny_causal_lm, tiny_gpt2, tiny_llama
from specdecode.cache.response_cache import runner_variant
from specdecode.cpu import cpu_flags
from specdecode.kernels import tree_attention
from specdecode.runners import HFModelRunner
from specdecode.runners.fast_gpt2 import FastGPT2Runner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.slots import SlotPool

DTYPES = [torch.bfloat16, torch.float32]
GROUPINGS = [(4, 4), (4, 2), (6, 2), (9, 3), (4, 1)]  # (query heads, key/value heads)
D = 64

kernel = tree_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler: the tree attention kernel is not built")


def random_attention(heads: int, kv_heads: int, n: int, capacity: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, n, D, generator=generator).to(dtype)
    keys = torch.randn(kv_heads, capacity, D, generator=generator).to(dtype)
    values = torch.randn(kv_heads, capacity, D, generator=generator).to(dtype)
    return q, keys, values


def run_kernel(q, keys, values, contiguous: list[int], extra: list[list[int]] | None = None) -> torch.Tensor:
    n = q.shape[1]
    width = max((len(e) for e in extra), default=0) if extra else 0
    extras = torch.full((n, width), -1, dtype=torch.int32)
    for i, row in enumerate(extra or []):
        extras[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    out = torch.empty_like(q)
    kernel(q, keys, values, torch.tensor(contiguous, dtype=torch.int32), extras, D**-0.5, out)
    return out  # [heads, n, D]


def sdpa_alone(q, keys, values, seen: list[int]) -> torch.Tensor:  # float32 reference, one query at a time
    group = q.shape[0] // keys.shape[0]
    k, v = keys.float().repeat_interleave(group, 0), values.float().repeat_interleave(group, 0)
    rows = [F.scaled_dot_product_attention(q[:, i : i + 1].float(), k[:, :s], v[:, :s]) for i, s in enumerate(seen)]
    return torch.cat(rows, dim=1)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grouping", GROUPINGS, ids=[f"{h}q{k}kv" for h, k in GROUPINGS])
def test_a_query_gets_the_same_bits_alone_among_others_and_with_its_keys_elsewhere(dtype, grouping):
    heads, kv_heads = grouping
    for seed, (length, n) in enumerate([(1, 2), (15, 3), (16, 7), (17, 20), (40, 5), (203, 13), (64, 16)]):
        q, keys, values = random_attention(heads, kv_heads, n, 2 * (length + n) + n + 8, dtype, seed)
        seen = [length + i + 1 for i in range(n)]  # a chain: query i sees the cache and the new tokens up to itself
        together = run_kernel(q, keys, values, seen)
        for i in range(n):
            alone = run_kernel(q[:, i : i + 1], keys, values, [seen[i]])
            assert torch.equal(alone[:, 0], together[:, i]), (length, n, i)
        torch.testing.assert_close(
            together.float(), sdpa_alone(q, keys, values, seen), **_tolerance(dtype), msg=f"{length}, {n}"
        )
        # the same logical keys with the last m of them moved to other slots, as a tree node's ancestors
        for m in {1, min(n, 6), seen[-1]}:
            moved_keys, moved_values = keys.clone(), values.clone()
            last = seen[-1]
            slots = [last + n + 2 + j for j in range(m)]
            slots[-1] = keys.shape[1] - 1  # not in order of slot either
            for j, slot in enumerate(slots):
                moved_keys[:, slot], moved_values[:, slot] = keys[:, last - m + j], values[:, last - m + j]
                moved_keys[:, last - m + j] = moved_values[:, last - m + j] = 9.0  # what must not be read
            elsewhere = run_kernel(q[:, -1:], moved_keys, moved_values, [last - m], [slots])
            assert torch.equal(elsewhere[:, 0], together[:, -1]), (length, n, m)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_gives_the_same_bits_on_any_number_of_threads(dtype):
    threads = torch.get_num_threads()
    for seed, (length, n) in enumerate([(3, 1), (203, 1), (200, 16), (57, 9)]):
        q, keys, values = random_attention(9, 3, n, length + n + 20, dtype, seed)
        seen, extra = [length] * n, [[length + j for j in range(i + 1)] for i in range(n)]  # a chain as a tree
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            try:
                results.append(run_kernel(q, keys, values, seen, extra))
            finally:
                torch.set_num_threads(threads)
        assert all(torch.equal(results[0], r) for r in results[1:])
        assert torch.equal(results[0], run_kernel(q, keys, values, [length + i + 1 for i in range(n)]))


@needs_kernel
@pytest.mark.parametrize("head_dim", [8, 40, 128])
def test_head_sizes_other_than_64_pad_to_16_lanes_and_keep_the_property(head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    n, length = 7, 37
    q = torch.randn(6, n, head_dim, generator=generator).bfloat16()
    keys, values = (torch.randn(2, 64, head_dim, generator=generator).bfloat16() for _ in range(2))
    seen = [length + i + 1 for i in range(n)]
    extras = torch.full((n, 1), -1, dtype=torch.int32)

    def attention(q, contiguous, extra=extras):
        out = torch.empty_like(q)
        kernel(q, keys, values, torch.tensor(contiguous, dtype=torch.int32), extra[: q.shape[1]], head_dim**-0.5, out)
        return out

    together = attention(q, seen)
    for i in range(n):
        assert torch.equal(attention(q[:, i : i + 1], [seen[i]])[:, 0], together[:, i])
    reference = torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, i : i + 1].float(),
                *(t[:, :s].float().repeat_interleave(3, 0) for t in (keys, values)),
                scale=head_dim**-0.5,
            )
            for i, s in enumerate(seen)
        ],
        dim=1,
    )
    torch.testing.assert_close(together.float(), reference, atol=1e-2, rtol=1e-2)


@needs_kernel
def test_a_small_model_with_16_wide_heads_verifies_trees_and_one_with_8_wide_heads_does_not():
    """The runner takes the kernel for head sizes of 16 lanes (the helpers' tiny_llama has 8)."""
    small = tiny_causal_lm(LlamaForCausalLM, LlamaConfig, 1, hidden_size=64, tie_word_embeddings=False)
    runner = FastLlamaRunner(small)
    assert runner.head_dim == 16 and runner.verifies_trees
    prompt = torch.tensor([3, 5, 7, 2, 9])
    tokens, parents = [4, 8, 1, 1, 6, 2, 0, 5], [-1, 0, 0, 1, 3, -1, 5, 2]
    tree = tree_logits(runner, prompt, tokens, parents)
    assert nodes_differing(runner, prompt, tokens, parents, tree) == 0
    assert not FastLlamaRunner(tiny_llama(seed=1)).verifies_trees


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the negative control was measured on AVX512-BF16 CPUs")
def test_sdpa_batched_with_a_causal_mask_would_round_queries_otherwise_than_alone():
    """Negative control of the kernel test: the property is not one every attention has."""
    differ = 0
    for seed, (length, n) in enumerate([(17, 5), (17, 8), (203, 5), (203, 8)]):
        q, keys, values = random_attention(9, 3, n, length, torch.bfloat16, seed)
        k, v = keys.repeat_interleave(3, 0), values.repeat_interleave(3, 0)
        mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        batched = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        alone = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[None, :, i : i + 1], k[None, :, : length - n + i + 1], v[None, :, : length - n + i + 1]
                )[0]
                for i in range(n)
            ],
            dim=1,
        )
        differ += int((batched != alone).sum())
    assert differ > 0


def llama_runner(dtype: torch.dtype, kv_heads: int = 2, seed: int = 0) -> FastLlamaRunner:
    """hidden 256 with head_dim 64: the default model's head size, several key/value groupings."""
    model = head64_llama(seed, dtype, kv_heads=kv_heads, tie_word_embeddings=False, initializer_range=0.1)
    return FastLlamaRunner(model)


def random_tree(rng: random.Random, size: int, depth: int, branching: int) -> list[int]:
    """Parents (within the new tokens, -1: the last cached token) of a random tree in
    topological order, at most `depth` deep and `branching` children per node."""
    parents, depths, children = [], [], {}
    while len(parents) < size:
        candidates = [-1] + [i for i in range(len(parents)) if depths[i] < depth]
        parent = rng.choice([c for c in candidates if children.get(c, 0) < branching] or [-1])
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        children[parent] = children.get(parent, 0) + 1
    return parents


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def decoded_alone(runner: FastLlamaRunner, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of decoding tokens one at a time after the prompt, on a fresh cache."""
    runner.reset()
    runner.forward(prompt, 1)
    return torch.cat([runner.forward(torch.tensor([t]), 1) for t in tokens])


def tree_case(seed: int, size: int, depth: int, branching: int):
    rng = random.Random(seed)
    prompt = torch.tensor([rng.randrange(256) for _ in range(rng.randrange(5, 60))])
    return prompt, [rng.randrange(256) for _ in range(size)], random_tree(rng, size, depth, branching)


TREES = [(2, 1, 2), (5, 1, 4), (8, 3, 2), (12, 6, 1), (16, 4, 3), (30, 6, 4), (30, 2, 4), (20, 5, 2)]


def tree_logits(runner: FastLlamaRunner, prompt: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
    runner.reset()
    runner.forward(prompt, 1)
    return runner.forward(torch.tensor(tokens), len(tokens), torch.tensor(parents))


def nodes_differing(runner, prompt, tokens, parents, tree: torch.Tensor, truth: list[int] | None = None) -> int:
    """Nodes whose tree logits are not bitwise those of decoding their path (under `truth`'s parents) alone."""
    truth = parents if truth is None else truth
    differ = 0
    for node in range(len(tokens)):
        path = path_to(truth, node)
        alone = decoded_alone(runner, prompt, [tokens[i] for i in path])[-1]
        differ += not torch.equal(alone, tree[node])
    return differ


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_every_node_of_a_tree_gets_the_logits_of_decoding_its_path_alone(dtype, kv_heads):
    runner = llama_runner(dtype, kv_heads)
    assert runner.verifies_trees
    for seed, shape in enumerate(TREES):
        prompt, tokens, parents = tree_case(seed, *shape)
        tree = tree_logits(runner, prompt, tokens, parents)
        assert nodes_differing(runner, prompt, tokens, parents, tree) == 0, (shape, parents)


@needs_kernel
def test_a_tree_with_a_wrong_parent_or_positions_by_slot_would_differ(monkeypatch):
    """Negative controls: the parents and the depth positions are what the bits follow."""
    runner = llama_runner(torch.bfloat16)
    prompt, tokens, parents = tree_case(5, 16, 4, 3)
    wrong = list(parents)
    node = next(i for i, p in enumerate(parents) if p >= 0)
    wrong[node] = -1 if parents[node] != -1 else 0
    assert nodes_differing(runner, prompt, tokens, parents, tree_logits(runner, prompt, tokens, wrong)) > 0
    monkeypatch.setattr(
        FastLlamaRunner, "_rows", staticmethod(lambda table, length, n, tree: table[length : length + n])
    )
    assert nodes_differing(runner, prompt, tokens, parents, tree_logits(runner, prompt, tokens, parents)) > 0


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_decoding_after_keep_goes_on_as_if_the_path_was_decoded_alone(dtype):
    runner = llama_runner(dtype)
    for seed, shape in enumerate(TREES[:5]):
        prompt, tokens, parents = tree_case(seed, *shape)
        leaf = max(range(len(tokens)), key=lambda i: (len(path_to(parents, i)), i))
        path = path_to(parents, leaf)
        tree_logits(runner, prompt, tokens, parents)
        runner.keep(len(prompt), path)
        assert runner.cache_length == len(prompt) + len(path)
        after_keep = torch.cat([runner.forward(torch.tensor([t]), 1) for t in (7, 11)])
        alone = decoded_alone(runner, prompt, [tokens[i] for i in path] + [7, 11])[-2:]
        assert torch.equal(after_keep, alone), (shape, path)


@needs_kernel
def test_keep_after_the_cache_grew_during_the_tree_forward():
    """A tree forward that outgrows the cache reallocates it under inference mode; keep must
    still move the path's rows (a prompt longer than the first capacity, as long prompts are)."""
    runner = llama_runner(torch.bfloat16)
    prompt, tokens, parents = tree_case(3, *TREES[2])
    runner.cache = runner.new_cache(capacity=len(prompt) + 1)  # the tree's nodes do not fit
    leaf = max(range(len(tokens)), key=lambda i: (len(path_to(parents, i)), i))
    path = path_to(parents, leaf)
    tree_logits(runner, prompt, tokens, parents)
    assert runner.cache.capacity >= len(prompt) + len(tokens)
    runner.keep(len(prompt), path)
    after_keep = runner.forward(torch.tensor([7]), 1)
    alone = decoded_alone(runner, prompt, [tokens[i] for i in path] + [7])[-1:]
    assert torch.equal(after_keep, alone)


@needs_kernel
def test_keep_refuses_what_is_not_a_path_of_the_last_tree():
    runner = llama_runner(torch.float32)
    prompt = torch.arange(10)
    runner.forward(prompt, 1)
    runner.forward(torch.tensor([1, 2, 3, 4]), 4, torch.tensor([-1, 0, 0, 2]))
    for offsets in ([1], [0, 3], [0, 2, 1], [0, 5]):
        with pytest.raises(ValueError, match="not a path"):
            runner.keep(10, offsets)
    runner.keep(10, [0, 2, 3])
    assert runner.cache_length == 13
    runner.forward(torch.tensor([5, 6]), 2)  # a chain: only its prefixes may be kept
    with pytest.raises(ValueError, match="not a path"):
        runner.keep(13, [1])
    runner.keep(13, [0])
    assert runner.cache_length == 14


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_trees_in_one_batch_get_the_bits_each_gets_alone(dtype):
    runner = llama_runner(dtype)
    cases = [tree_case(seed, *shape) for seed, shape in ((1, (16, 4, 3)), (2, (5, 2, 4)), (3, (30, 6, 2)))]
    chain = (torch.arange(30) % 256, [9, 8, 7, 6], None)  # a chain verification shares the batch

    def run(group):
        caches = [runner.new_cache() for _ in group]
        runner.forward_batch(caches, [prompt for prompt, _, _ in group], [1] * len(group))
        parents = [None if p is None else torch.tensor(p) for _, _, p in group]
        logits = runner.forward_batch(
            caches, [torch.tensor(t) for _, t, _ in group], [len(t) for _, t, _ in group], parents
        )
        return logits, caches

    together, caches = run(cases + [chain])
    for case, batched in zip(cases + [chain], together):
        assert torch.equal(run([case])[0][0], batched)
    for (prompt, tokens, parents), logits in zip(cases, together):
        assert nodes_differing(runner, prompt, tokens, parents, logits) == 0
    pool = SlotPool(runner)  # and through slots: keep on each slot's cache
    slots = [pool.acquire() for _ in cases]
    pool.forward(slots, [prompt for prompt, _, _ in cases], [1] * len(cases))
    pool.forward(
        slots,
        [torch.tensor(t) for _, t, _ in cases],
        [len(t) for _, t, _ in cases],
        [torch.tensor(p) for _, _, p in cases],
    )
    for slot, (prompt, tokens, parents) in zip(slots, cases):
        path = path_to(parents, len(tokens) - 1)
        pool.keep(slot, len(prompt), path)
        assert pool.cache_length(slot) == len(prompt) + len(path)


def test_without_the_kernel_the_runner_says_it_verifies_no_trees_and_chains_stay_exact(monkeypatch, caplog):
    monkeypatch.setattr(tree_attention, "_loaded", {})

    def no_compiler(key: str):
        raise RuntimeError("no gcc on PATH")

    monkeypatch.setattr(tree_attention, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specdecode.kernels.tree_attention"):
        runner = llama_runner(torch.bfloat16)
    assert "tree attention kernel unavailable" in caplog.text
    assert not runner.verifies_trees and runner.per_query_attention and runner.attention_kernel == "sdpa"
    with pytest.raises(ValueError, match="does not verify trees"):
        runner.forward(torch.tensor([1, 2]), 2, torch.tensor([-1, -1]))
    prompt, tokens = torch.arange(40) % 256, [5, 9, 200, 3, 17, 42]
    runner.forward(prompt, 1)
    verified = runner.forward(torch.tensor(tokens), len(tokens))
    assert torch.equal(verified, decoded_alone(runner, prompt, tokens))


@needs_kernel
def test_the_response_cache_tells_the_kernel_from_the_old_attention():
    runner = llama_runner(torch.bfloat16)
    with_kernel = runner_variant(runner)
    assert tree_attention.kernel_identity() in with_kernel
    runner._kernel = None
    assert runner_variant(runner) != with_kernel


def test_runners_without_trees_say_so_and_keep_only_prefixes():
    for runner in (HFModelRunner(tiny_llama(seed=1)), FastGPT2Runner(tiny_gpt2(seed=1))):
        assert not runner.verifies_trees
        runner.forward(torch.tensor([1, 2, 3]), 1)
        runner.forward(torch.tensor([4, 5, 6]), 3)
        with pytest.raises(ValueError):
            runner.forward(torch.tensor([1, 2]), 2, torch.tensor([-1, 0]))
        with pytest.raises(ValueError):
            runner.keep(3, [0, 2])
        runner.keep(3, [0, 1])
        assert runner.cache_length == 5
