"""The llama.cpp side of `specdecode bench`, run as a process of its own (see llamacpp.py).

It speaks JSON lines: the first line in names the model and the settings, and is answered by
{"ready": ...} or {"error": ...}; then every line in is one generation, answered by its tokens,
its time and its counts. End of input ends the process.

The bench runs this file by path (`python -P llamacpp_worker.py`), never as part of the
package: importing specdecode would load torch into this process, and its threads with it.
So this file imports nothing of specdecode and nothing but the standard library and llama_cpp.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    # llama.cpp's C code may print to file descriptor 1: keep the protocol on a copy of it and
    # send everything printed to stdout, by Python or C, to stderr
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    settings = json.loads(sys.stdin.readline() or "null")
    if settings is None:
        return 0  # the bench closed the pipe before asking anything
    try:
        llm = load(settings)
    except Exception as error:  # noqa: BLE001 - any failure to load is one line for the bench
        send(protocol, {"error": f"{type(error).__name__}: {error}"})
        return 1
    send(protocol, describe(llm, settings))
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = generate(llm, request["prompt"], request["max_new_tokens"], set(request["stop"]))
        except Exception as error:  # noqa: BLE001 - as above
            send(protocol, {"error": f"{type(error).__name__}: {error}"})
            return 1
        send(protocol, answer)
    llm.close()
    return 0


def load(settings: dict):
    """A Llama on the .gguf file, with the prompt-lookup drafter where settings ask for one."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lookup = settings.get("num_pred_tokens")
    draft = None if lookup is None else LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = Llama(
        model_path=settings["model"],
        n_ctx=settings["n_ctx"],
        n_threads=settings["threads"],
        n_threads_batch=settings["threads"],
        flash_attn=settings["flash_attn"],
        draft_model=draft,
        # a drafter makes llama-cpp-python keep every row's logits, but it sizes their array by this
        # argument: left False, a prompt longer than a batch (512 tokens) fails with a drafter
        logits_all=draft is not None,
        seed=0,
        verbose=False,
    )
    counter = Counter()
    llm.eval = counter.counting_forwards(llm.eval)  # generate() calls self.eval once a forward
    if draft is not None:
        llm.draft_model = counter.counting_drafts(draft)
    llm.counter, llm.lookup = counter, draft
    return llm


class Counter:
    """Target forwards and drafted tokens of the generation under way."""

    def __init__(self):
        self.forwards = 0
        self.drafted = 0

    def counting_forwards(self, evaluate):
        def counted(tokens):
            self.forwards += 1
            return evaluate(tokens)

        return counted

    def counting_drafts(self, draft):
        def counted(input_ids):
            proposed = draft(input_ids)
            self.drafted += len(proposed)
            return proposed

        return counted


def describe(llm, settings: dict) -> dict:
    import llama_cpp

    return {
        "ready": True,
        "version": llama_cpp.__version__,
        "n_vocab": llm.n_vocab(),
        "n_ctx": llm.n_ctx(),
        "n_batch": llm.n_batch,
        # what the context was created with, not only what was asked for
        "flash_attn_type": int(llm.context_params.flash_attn_type),
        "n_threads": llm.context_params.n_threads,
        "n_threads_batch": llm.context_params.n_threads_batch,
        "num_pred_tokens": settings.get("num_pred_tokens"),
        "max_ngram_size": llm.lookup.max_ngram_size if llm.lookup is not None else None,
    }


def generate(llm, prompt: list[int], max_new_tokens: int, stop: set[int]) -> dict:
    """Greedy tokens after prompt, up to max_new_tokens or a stop token (kept, as transformers
    keeps it), timed from the prompt's ids in to the new ids out, prefill included."""
    counter = llm.counter
    counter.forwards = counter.drafted = 0
    start = time.perf_counter()
    llm.reset()  # no prefix reuse from an earlier prompt: every system prefills every prompt
    tokens = []
    stream = llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
    for token in stream:
        tokens.append(int(token))
        if token in stop or len(tokens) >= max_new_tokens:
            break
    stream.close()
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "forwards": counter.forwards, "drafted": counter.drafted}


def send(protocol, message: dict) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


if __name__ == "__main__":
    sys.exit(main())
