"""The CLI as a user meets it: help, inspect (human and JSON), errors as one line with exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from daemons.cli import main
from daemons.synthetic import write_synthetic_qwen35

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_commands():
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0
    assert "inspect" in r.output and "demo" in r.output


def test_subcommand_help_without_gguf_package():
    """Bug guarded: a subcommand's `--help` ends in click's Exit, which passed through the handler
    that imports the user-error types; with the `gguf` package missing that import raised, so
    `dflashd bench --help` printed its help and then a traceback."""
    code = ("import sys; sys.modules['gguf'] = None\n"
            "from daemons.cli import main\n"
            "main(['bench', '--help'], prog_name='dflashd')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Usage: dflashd bench" in r.stdout


def test_inspect_human_and_json(tmp_path):
    f = tmp_path / "m.gguf"
    write_synthetic_qwen35(f, "tiny", n_layer=8)
    r = CliRunner().invoke(main, ["inspect", str(f)])
    assert r.exit_code == 0, r.output
    assert "qwen35" in r.output and "layers:        8: (deltanet x3, attention) x2" in r.output
    assert "vocab 269" in r.output and "chat template: yes" in r.output
    r = CliRunner().invoke(main, ["inspect", str(f), "--json"])
    info = json.loads(r.output)
    assert info["architecture"] == "qwen35"
    assert info["layer_types"] == ["deltanet", "deltanet", "deltanet", "attention"] * 2
    assert info["metadata"]["qwen35.block_count"] == 8
    assert info["parameters"] > 0 and set(info["quantization_bytes"]) == {"F32"}
    assert info["tokenizer"]["vocab_size"] == 269


def test_bad_file_is_one_line_and_exit_2(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"not a gguf file at all, just some bytes")
    # through the real entry point, as a user runs it
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "daemons.cli", "inspect", str(f)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == f"dflashd: error: {f}: not a GGUF file (magic b'not ', expected b'GGUF')"
    assert "Traceback" not in r.stderr


def test_demo_without_embedded_model_says_so(tmp_path, monkeypatch):
    import daemons.cli as cli
    monkeypatch.setattr(cli, "MODELS_DIR", tmp_path)
    r = CliRunner().invoke(main, ["demo"])
    assert r.exit_code == 1
    assert "no embedded default model is installed" in r.output


def test_demo_serves_the_default_model_and_prints_a_continuation(tmp_path, monkeypatch):
    """The main job end to end: models/ holds a target, `demo` starts serve, streams one chat answer
    and its timings. (A synthetic random model: the text is noise, but it must be real output.)"""
    import daemons.cli as cli
    write_synthetic_qwen35(tmp_path / "tiny-target.gguf", "tiny")
    monkeypatch.setattr(cli, "MODELS_DIR", tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS="1")
    code = ("import daemons.cli as c, pathlib, sys; c.MODELS_DIR = pathlib.Path(sys.argv[1]); "
            "sys.argv = ['dflashd', 'demo']; c.main()")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "serving tiny-target.gguf" in r.stderr
    assert "tok/s" in r.stdout + r.stderr


def test_logits_writes_every_position(tmp_path):
    """`dflashd logits` must give exactly the model's prefill logits of every position (not just the
    last one, not a chunk-dependent variant)."""
    import numpy as np
    from daemons.qwen35 import Qwen35Model
    f = tmp_path / "m.gguf"
    write_synthetic_qwen35(f, "tiny", seed=3)
    out = tmp_path / "l.npy"
    r = CliRunner().invoke(main, ["logits", "-m", str(f), "--tokens", "5,6,7,8,9", "--out", str(out)])
    assert r.exit_code == 0, r.output
    got = np.load(out)
    model = Qwen35Model.load(f)
    want = model.prefill([5, 6, 7, 8, 9], model.new_state(8), logits="all")
    assert got.dtype == np.float32 and got.shape == (5, model.n_vocab)
    np.testing.assert_array_equal(got, want)


def test_generate_json_and_text(tmp_path):
    f = tmp_path / "m.gguf"
    write_synthetic_qwen35(f, "tiny", seed=3)
    r = CliRunner().invoke(main, ["generate", "-m", str(f), "--tokens", "72,105", "-n", "12", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["tokens"]) <= 12 and out["finish_reason"] in ("stop", "length")
    assert out["timings"]["generated_tokens"] >= len(out["tokens"])
    # greedy is deterministic; text mode prints the same continuation
    r2 = CliRunner().invoke(main, ["generate", "-m", str(f), "--tokens", "72,105", "-n", "12", "--json"])
    assert json.loads(r2.output)["tokens"] == out["tokens"]
    r3 = CliRunner().invoke(main, ["generate", "-m", str(f), "-p", "Hello", "--chat", "-n", "4"])
    assert r3.exit_code == 0, r3.output


def test_generate_user_errors_exit_2(tmp_path):
    f = tmp_path / "m.gguf"
    write_synthetic_qwen35(f, "tiny")
    r = CliRunner().invoke(main, ["generate", "-m", str(f), "--tokens", "1,99999", "-n", "2"])
    assert r.exit_code == 2 and "99999" in r.output
    r = CliRunner().invoke(main, ["generate", "-m", str(f), "--tokens", "1", "--temp", "-1"])
    assert r.exit_code == 2 and "temperature" in r.output
    r = CliRunner().invoke(main, ["logits", "-m", str(tmp_path / "nope.gguf"), "--tokens", "1", "--out", "x.npy"])
    assert r.exit_code == 2 and "cannot open" in r.output
