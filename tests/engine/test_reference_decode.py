"""`engine reference-decode`: transformers' own generate, timed as the speed gate times the server.

Run for real through `engine.cli.main` on a tiny checkpoint: the JSON line's fields, exactly N tokens,
the prompt counted as the tokenizer counts it, the timed run's tokens equal to `model.generate`'s,
and bad input refused in one line with the documented exit code.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.cli import main

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 * 23?"}]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("mixtral")


@pytest.fixture(scope="module")
def hf(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["reference-decode", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def reference_ids(model, prompt_ids, n, **sampling) -> list[int]:
    x = torch.tensor([prompt_ids])
    y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                       pad_token_id=model.config.pad_token_id, **(sampling or {"do_sample": False}))
    return y[0, len(prompt_ids):].tolist()


def test_greedy_prompt_reports_the_gate_fields_and_generates_what_generate_does(ckpt, hf, capsys):
    model, tok = hf
    rc, out, err = run(["--model", str(ckpt), "--prompt", PROMPT, "--tokens", "24", "--warmup", "2"], capsys)
    assert rc == 0, err
    r = last_json(out)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    assert r["tokens"] == 24 and len(r["token_ids"]) == 24
    assert r["prompt_tokens"] == len(ids)
    assert r["decode_tps"] > 0 and r["prefill_s"] > 0
    assert r["threads"] == torch.get_num_threads()
    assert (r["dtype"], r["temperature"], r["model"]) == ("float32", 0.0, str(ckpt))
    assert (r["transformers"], r["torch"]) == (transformers.__version__, torch.__version__)
    assert r["label"] == f"transformers {transformers.__version__} generate"
    # The timed run is transformers' greedy decode, token for token; EOS (<|im_end|>) did not stop it.
    assert r["token_ids"] == reference_ids(model, ids, 24)
    assert f"transformers {transformers.__version__} generate: 24 tokens, decode" in err


def test_messages_render_as_the_server_does_and_threads_are_set(ckpt, hf, capsys):
    from engine.server.chat import encode, render
    model, tok = hf
    rc, out, err = run(["--model", str(ckpt), "--messages", json.dumps(MESSAGES), "--tokens", "6",
                        "--threads", "1", "--warmup", "0"], capsys)
    assert rc == 0, err
    r = last_json(out)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r["prompt_tokens"] == len(ids) == len(encode(tok, render(tok, MESSAGES), add_special_tokens=False))
    assert r["threads"] == 1 and "1 threads" in err
    assert r["token_ids"] == reference_ids(model, ids, 6)


def test_sampling_is_plain_temperature_sampling(ckpt, hf, capsys):
    model, tok = hf
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    torch.manual_seed(7)
    rc, out, err = run(["--model", str(ckpt), "--prompt", PROMPT, "--tokens", "12", "--temperature", "1.5",
                        "--warmup", "0"], capsys)
    assert rc == 0, err
    r = last_json(out)
    assert r["temperature"] == 1.5 and r["tokens"] == 12
    torch.manual_seed(7)
    assert r["token_ids"] == reference_ids(model, ids, 12, do_sample=True, temperature=1.5, top_p=1.0, top_k=0)
    assert r["token_ids"] != reference_ids(model, ids, 12)      # it did sample (greedy would differ)


def test_bfloat16(ckpt, capsys):
    rc, out, err = run(["--model", str(ckpt), "--prompt", PROMPT, "--tokens", "3", "--dtype", "bfloat16",
                        "--warmup", "1"], capsys)
    assert rc == 0, err
    r = last_json(out)
    assert r["dtype"] == "bfloat16" and len(r["token_ids"]) == 3


@pytest.fixture(scope="module")
def no_template(tmp_path_factory, ckpt):
    import shutil
    d = tmp_path_factory.mktemp("no_template")
    for p in ckpt.iterdir():
        shutil.copy(p, d / p.name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    return d


@pytest.mark.parametrize("argv, code, words", [
    (["--prompt", "x", "--tokens", "4"], 2, "exactly one of --model DIR or --gguf FILE"),
    (["--model", "{ckpt}", "--gguf", "{tmp}/a.gguf", "--prompt", "x", "--tokens", "4"], 2, "exactly one of --model"),
    (["--model", "{ckpt}", "--tokens", "4"], 2, "exactly one of --messages JSON or --prompt TEXT"),
    (["--model", "{ckpt}", "--prompt", "x", "--messages", "[]", "--tokens", "4"], 2, "exactly one of --messages"),
    (["--model", "{ckpt}", "--messages", "[{\"role\": \"user\",", "--tokens", "4"], 2, "--messages: not valid JSON"),
    (["--model", "{ckpt}", "--messages", "{\"role\": \"user\"}", "--tokens", "4"], 2, "--messages: want"),
    (["--model", "{ckpt}", "--prompt", "", "--tokens", "4"], 2, "no tokens"),
    (["--model", "{tmp}/nowhere", "--prompt", "x", "--tokens", "4"], 3, "nowhere: no such model directory"),
    (["--gguf", "{tmp}/nothing.gguf", "--prompt", "x", "--tokens", "4"], 3, "nothing.gguf: no such GGUF file"),
    (["--gguf", "{tmp}/junk.gguf", "--prompt", "x", "--tokens", "4"], 3, "junk.gguf: transformers cannot load"),
    (["--model", "{tmp}", "--prompt", "x", "--tokens", "4"], 3, "transformers cannot load this checkpoint"),
    (["--model", "{no_template}", "--messages", "[{\"role\": \"user\", \"content\": \"hi\"}]", "--tokens", "4"],
     2, "no chat template"),
])
def test_bad_input_is_one_line_and_a_documented_exit_code(argv, code, words, ckpt, no_template, tmp_path, capsys):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00\x01" * 100)
    argv = [a.replace("{ckpt}", str(ckpt)).replace("{tmp}", str(tmp_path)).replace("{no_template}", str(no_template))
            for a in argv]
    rc, out, err = run(argv, capsys)
    assert rc == code, err
    assert out == ""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]


def test_tokens_below_two_is_a_usage_error(ckpt, capsys):
    rc, out, err = run(["--model", str(ckpt), "--prompt", "x", "--tokens", "1"], capsys)
    assert (rc, out) == (2, "") and "--tokens" in err and "Traceback" not in err


@pytest.mark.slow
def test_smollm2_gguf_with_messages(capsys):
    from tests.fixtures.smollm2 import smollm2_gguf
    gguf = smollm2_gguf()
    rc, out, err = run(["--gguf", str(gguf), "--messages", json.dumps(MESSAGES), "--tokens", "4", "--warmup", "1"],
                       capsys)
    assert rc == 0, err
    r = last_json(out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r["prompt_tokens"] == len(ids)
    assert r["tokens"] == 4 and len(r["token_ids"]) == 4 and r["decode_tps"] > 0
    assert (r["model"], r["dtype"]) == (str(gguf), "float32")
