"""bitsandbytes nf4 and int8 targets on CUDA against bfloat16: memory, tokens/s, greedy identity.

For a session with a GPU (not run on the CPU-only development machine). For each target:
the default model (smollm2-135m-instruct, offline) and a gpt2-medium-sized target with a
distilgpt2-sized draft (random weights, so no Hub is needed; the pair shapes of the seed
brief), loaded in bfloat16, nf4 (bfloat16 compute) and int8 (LLM.int8):

- GPU memory the weights take (`get_memory_footprint`) and the peak CUDA memory of a generation;
- target-only tokens/s and speculative tokens/s (prompt lookup; and the draft model for GPT-2),
  medians over the prompts, after a warm-up;
- greedy identity: speculative output == target-only output of the same quantized model, per
  prompt (exactness relative to the model that runs), and the share of bfloat16's greedy
  tokens each quantized model reproduces (how far quantizing moved the model).

    .venv/bin/python benchmarks/gpu_quantization.py [--device cuda] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from specdecode import SpeculativeEngine
from specdecode.bench.interleave import interleave, medians
from specdecode.bench.prompts import COPY_PROMPTS, OPEN_PROMPTS
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.loading import bnb_config, load_model
from specdecode.runners import runner_for

PROMPTS = [COPY_PROMPTS[0], *OPEN_PROMPTS[:2]]  # one copy-type, two open-ended
PRECISIONS = (None, "nf4", "llm-int8")  # None: bfloat16


def random_gpt2_pair(folder: Path) -> tuple[Path, GPT2LMHeadModel]:
    """A gpt2-medium-sized target saved with random weights (to load it quantized), and a
    distilgpt2-sized draft with random weights, in memory."""
    shapes = {"target": dict(n_layer=24, n_embd=1024, n_head=16), "draft": dict(n_layer=6, n_embd=768, n_head=12)}
    models = {}
    for name, shape in shapes.items():
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=50257, n_positions=1024, eos_token_id=None, bos_token_id=None, **shape)
        models[name] = GPT2LMHeadModel(config).eval()
    models["target"].save_pretrained(folder / "target")
    return folder / "target", models["draft"]


def loader(target: str | Path, device: str):
    """quantization -> (model, tokenizer): the offline default by name, the random GPT-2 from its folder."""
    if isinstance(target, str):
        return lambda quantization: load_model(target, device, "bfloat16", quantization=quantization)

    def load(quantization):
        extra = {}
        if quantization is not None:
            extra = dict(quantization_config=bnb_config(quantization, torch.device(device)), device_map={"": device})
        model = GPT2LMHeadModel.from_pretrained(target, dtype=torch.bfloat16, **extra)
        return (model if extra else model.to(device)).eval(), None

    return load


def measure(load, quantization: str | None, prompts: list[list[int]], new_tokens: int, draft) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, tokenizer = load(quantization)
    engine = SpeculativeEngine(model, tokenizer, PromptLookupDrafter(), num_speculative_tokens=4, adaptive=True)
    systems = {"prompt lookup": engine}
    if draft is not None:
        systems["draft model"] = engine.with_drafter(ModelDrafter(runner_for(draft)), 4, adaptive=True)
    weights = model.get_memory_footprint()

    def decode(view: SpeculativeEngine, speculative: bool = True):
        return lambda ids: view.generate([ids], max_new_tokens=new_tokens, speculative=speculative)[0]

    named = {"target-only": decode(engine, False)} | {name: decode(view) for name, view in systems.items()}
    runs = interleave(named, prompts, warm_up=1)
    greedy = [r.value.token_ids for r in runs if r.system == "target-only"]  # in prompt order
    speed = medians(runs, key=lambda run: run.value.stats.tokens_per_second)
    same = {name: sum(r.value.token_ids == greedy[r.item] for r in runs if r.system == name) for name in systems}
    return dict(
        precision=engine.precision,
        weights=weights,
        peak=torch.cuda.max_memory_allocated(),
        target_only=speed["target-only"],
        speculative={name: (speed[name], same[name]) for name in systems},
        greedy=greedy,
    )


def main() -> None:
    parser = script_parser(__doc__, device="cuda", max_new_tokens=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: this script is for a session with one")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, load, prompts, draft_model in targets(Path(folder), args.device):
            if draft_model is not None:
                draft_model = draft_model.to(args.device, torch.bfloat16)
            reference = None
            for quantization in PRECISIONS:
                r = measure(load, quantization, prompts, args.max_new_tokens, draft_model)
                reference = reference or r["greedy"]
                reproduced = statistics.mean(
                    next((i for i, (a, b) in enumerate(zip(g, ref)) if a != b), len(ref)) / max(len(ref), 1)
                    for g, ref in zip(r["greedy"], reference)
                )
                spec = ", ".join(
                    f"{name} {tps:.1f} ({same}/{len(prompts)})" for name, (tps, same) in r["speculative"].items()
                )
                rows.append(
                    [label, r["precision"], f"{r['weights'] / 1e6:.0f}", f"{r['peak'] / 1e6:.0f}"]
                    + [f"{r['target_only']:.1f}", spec, f"{reproduced:.0%}"]
                )
                print(rows[-1], flush=True)
    header = ["target", "precision", "weights MB", "peak CUDA MB", "target-only tok/s"]
    header += ["speculative tok/s (identical to target-only)", "bfloat16 greedy tokens reproduced"]
    title = f"{torch.cuda.get_device_name()}, {args.max_new_tokens} new tokens, greedy, {len(PROMPTS)} prompts."
    write_table(f"{title}\n\n{markdown_table(header, rows)}", args.out)


def targets(folder: Path, device: str) -> list[tuple]:
    """(label, loader, prompt ids, draft model or None) of each target."""
    _, tokenizer = load_model("smollm2-135m-instruct", "cpu")
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS
    ]
    gpt2_folder, draft = random_gpt2_pair(folder)
    generator = torch.Generator().manual_seed(0)
    random_prompts = []
    for _ in PROMPTS:  # random ids with a repeated stretch, for prompt lookup to find
        ids = torch.randint(0, 50257, (40,), generator=generator).tolist()
        random_prompts.append(ids + ids[:20])
    return [
        ("smollm2-135m-instruct", loader("smollm2-135m-instruct", device), chat, None),
        ("gpt2-medium-sized (random), distilgpt2-sized draft", loader(gpt2_folder, device), random_prompts, draft),
    ]


if __name__ == "__main__":
    main()
