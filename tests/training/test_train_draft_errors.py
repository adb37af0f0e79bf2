"""train-draft's user errors, through the command as a user runs it, on a tiny model:

- a --prompts file's lines end at "\\n" alone: prompts holding U+2028, U+2029 or U+0085 (legal
  unescaped in a JSON string, line breaks to str.splitlines) are read whole;
- a --prompts line that is not JSON, not an object or not UTF-8 ends the command with one line
  naming the file and the line (exit status 2, no traceback), and leaves no manifest behind
  that the fixed file's rerun would be refused by; a hand-made data.jsonl likewise;
- a checkpoint.pt cut short ends the command with one line naming it and --restart-training,
  which trains afresh on the data already in --output (not decoded again, its files unchanged)
  and ends with the weights of the first run;
- --input-norms and --no-input-norms reach the head's config.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specdecode.cli import app
from specdecode.training import data, datafiles


def prompts_file(folder, lines: list[bytes]):
    path = folder / "prompts.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def prompt_line(text: str) -> bytes:
    return json.dumps({"prompt": text}, ensure_ascii=False).encode()


def train_draft(target, output, prompts, *options: str, samples: int = 2):
    args = ["train-draft", "--target", target, "--output", str(output), "--prompts", str(prompts)]
    args += ["--samples", str(samples), "--max-new-tokens", "4", "--epochs", "1", "--vocab-size", "8"]
    return CliRunner().invoke(app, [*args, *options])


def error_line(result) -> str:
    """The one line of a refusal (the progress bars drawn before it aside), no traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    return errors[0]


def no_decoding(*args, **kwargs):
    raise AssertionError("the data was decoded again")


def test_prompts_holding_unicode_line_breaks_are_read_whole(tiny_model_dir, tmp_path, monkeypatch):
    texts = ["w1\u2028w2 w3", "w4\u2029w5 w6", "w7\x85w8 w9"]
    prompts = prompts_file(tmp_path, [prompt_line(text) for text in texts])
    assert all(text in prompts.read_text(encoding="utf-8") for text in texts)  # raw, not escaped
    answered, answer_batch = [], data.answer_batch

    def recording(engine, block, *args, **kwargs):
        answered.extend(block)
        return answer_batch(engine, block, *args, **kwargs)

    monkeypatch.setattr(data, "answer_batch", recording)
    result = train_draft(str(tiny_model_dir), tmp_path / "head", prompts, samples=6)
    assert result.exit_code == 0, result.output
    assert answered == texts + texts  # each answered greedily, then sampled


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b'{"prompt": "w1 w2"', "is not JSON"),
        (b'["w1 w2"]', "is not a JSON object"),
        (b'{"prompt": "w1 \xff w2"}', "is not UTF-8"),
    ],
)
def test_a_bad_prompts_line_is_refused_in_one_line_naming_it(tiny_model_dir, tmp_path, line, says):
    prompts = prompts_file(tmp_path, [prompt_line("w1 w2 w3"), prompt_line("w4 w5"), line, prompt_line("w6")])
    output = tmp_path / "head"
    message = error_line(train_draft(str(tiny_model_dir), output, prompts))
    assert f"{prompts}, line 3, {says}" in message
    assert not (output / datafiles.MANIFEST).exists()  # the fixed file's rerun is not refused for its digest


def test_a_bad_line_of_a_hand_made_data_file_is_refused_in_one_line_naming_it(tiny_model_dir, tmp_path):
    output = tmp_path / "head"
    output.mkdir()
    sample = json.dumps({"prompt_ids": [4, 5], "answer_ids": [6, 0], "sampled": False}).encode()
    (output / datafiles.DATA).write_bytes(sample + b"\n" + sample[:-5] + b"\n")
    prompts = prompts_file(tmp_path, [prompt_line("w1 w2 w3")])
    message = error_line(train_draft(str(tiny_model_dir), output, prompts))
    assert f"{output / datafiles.DATA}, line 2, is not JSON" in message


def test_a_checkpoint_cut_short_is_refused_and_restart_training_keeps_the_data(tiny_model_dir, tmp_path, monkeypatch):
    prompts = prompts_file(tmp_path, [prompt_line(f"w{i} w{i + 1} w{i + 2}") for i in range(4)])
    output, target = tmp_path / "head", str(tiny_model_dir)
    assert train_draft(target, output, prompts).exit_code == 0
    files = (datafiles.MANIFEST, datafiles.ANSWERS, datafiles.DATA, "head.safetensors")
    first = {name: (output / name).read_bytes() for name in files}
    checkpoint = output / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])  # a file cut short, as a full disk leaves one
    monkeypatch.setattr(data, "answer_batch", no_decoding)
    message = error_line(train_draft(target, output, prompts))
    assert str(checkpoint) in message and "rerun with --restart-training" in message
    result = train_draft(target, output, prompts, "--restart-training")
    assert result.exit_code == 0, result.output
    assert {name: (output / name).read_bytes() for name in files} == first  # the data kept, the same weights
    assert torch.load(checkpoint, weights_only=True)["state"]["step"] == 1


def test_the_head_has_input_norms_unless_no_input_norms_is_given(tiny_model_dir, tmp_path):
    """--input-norms (the default) and --no-input-norms reach the saved head's config."""
    prompts = prompts_file(tmp_path, [prompt_line(f"w{i} w{i + 1}") for i in range(2)])
    for option, expected in (("--input-norms", True), ("--no-input-norms", False)):
        output = tmp_path / option
        result = train_draft(str(tiny_model_dir), output, prompts, option)
        assert result.exit_code == 0, result.output
        assert json.loads((output / "config.json").read_text())["input_norms"] is expected
