"""The `dflashd` command line.

User errors (bad files, bad arguments, unusable devices) print one line `dflashd: error: ...` on
stderr and exit with status 2; no traceback. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

EXIT_USER_ERROR = 2
REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean 'the input is wrong', imported lazily to keep `--help` fast."""
    errors: list[type[BaseException]] = []
    # (each import may fail where an optional or broken dependency is missing: `--help` and the
    # commands that need none of these must still work, so a missing one only drops its type)
    for module, name in (("daemons.gguf_reader", "GGUFError"),
                         ("daemons.tokenizer", "TokenizerError"),
                         ("daemons.chat_template", "ChatTemplateError"),
                         ("daemons.convert", "ConvertError"),
                         ("daemons.sampling", "SamplingError"),
                         ("daemons.generate", "GenerationError"),
                         ("daemons.qwen35", "ModelInputError"),
                         ("daemons.dflash", "DraftModelError"),
                         ("kernels.backend", "BackendError"),
                         ("kernels.ggml_quants", "UnsupportedQuantType")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


# Commands that live beside the code they drive, loaded only when invoked (keeps `--help` and
# `inspect` from importing ZeroMQ, FastAPI or the model code): name -> "module:attribute".
LAZY_COMMANDS = {
    "worker": "daemons.worker_cli:worker",
    "serve": "router.cli:serve",
    "router": "router.cli:router",
    "bench": "daemons.bench:bench",
}


def _unavailable(name: str, why: str) -> click.Command:
    def fail() -> None:
        raise click.ClickException(f"'{name}' is unavailable: {why}")
    return click.Command(name, help=f"(unavailable: {why})", callback=fail)


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, name: str):
        if name in LAZY_COMMANDS:
            module, attr = LAZY_COMMANDS[name].split(":")
            try:
                return getattr(__import__(module, fromlist=[attr]), attr)
            except ImportError as e:
                # e.g. an optional dependency missing: the rest of the CLI keeps working
                return _unavailable(name, str(e))
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except _user_errors() as e:
            click.echo(f"dflashd: error: {e}", err=True)
            ctx.exit(EXIT_USER_ERROR)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """dflashd: serve GGUF language models with DFlash speculative decoding."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every metadata key.")
def inspect(file: Path, as_json: bool) -> None:
    """Describe a GGUF file: architecture, parameters, layers, quantisation, tokenizer."""
    from daemons.gguf_reader import GGUFFile
    from daemons.model_info import describe, format_human, validate
    with GGUFFile(file) as g:
        info = describe(g, with_metadata=as_json)
        if info["served_by"]:
            validate(g)  # shapes, types, tokenizer: what a worker would refuse, inspect refuses too
    if as_json:
        click.echo(json.dumps(info, ensure_ascii=False, default=str))
    else:
        click.echo(format_human(info))


@main.command()
@click.argument("hf_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f16", show_default=True,
              help="Storage type of the matrices (1-D tensors stay F32, as llama.cpp's converter keeps them).")
@click.option("--target", "target_gguf", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="DFlash drafts only: copy this target GGUF's tokenizer into the draft (llama.cpp needs one).")
def convert(hf_dir: Path, out: Path, outtype: str, target_gguf: Path | None) -> None:
    """Convert a Hugging Face checkpoint (safetensors + config.json + tokenizer.json) to GGUF.
    A z-lab DFlash draft directory becomes a GGUF in llama.cpp's `dflash` layout."""
    from daemons.convert import convert_dflash_to_gguf, convert_hf_to_gguf
    try:
        archs = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []                       # convert_hf_to_gguf reports a missing or bad config.json
    if any("DFlash" in str(a) for a in archs):
        r = convert_dflash_to_gguf(hf_dir, out, outtype, target_gguf=target_gguf)
        click.echo(f"wrote {r.path}: dflash draft, {r.outtype}, {r.n_tensors} tensors, {r.n_params:,} parameters")
        return
    if target_gguf is not None:
        raise click.UsageError("--target applies to DFlash draft directories only")
    r = convert_hf_to_gguf(hf_dir, out, outtype)
    click.echo(f"wrote {r.path}: {r.outtype}, {r.n_tensors} tensors, {r.n_params:,} parameters, vocab {r.n_vocab}")


def _device_option(f):
    return click.option("--device", default="cpu", show_default=True,
                        help="cpu, cuda:N or hip:N")(f)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint="--tokens")
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--tokens")
    return ids


@main.command()
@click.option("--model", "-m", "model_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tokens", required=True, help="Comma-separated token ids of one prompt.")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Output .npy: float32 [n_tokens, vocab], the logits of every position.")
@_device_option
def logits(model_path: Path, tokens: str, out: Path, device: str) -> None:
    """Logits of every position of one prefill."""
    import numpy as np
    from daemons.architectures import load_model
    ids = _parse_ids(tokens)
    model = load_model(str(model_path), device)
    state = model.new_state(len(ids))
    result = np.asarray(model.prefill(ids, state, logits="all"), dtype=np.float32)
    np.save(out, result)
    click.echo(f"wrote {out}: float32 {list(result.shape)}")


@main.command()
@click.option("--model", "-m", "model_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--prompt", "-p", default=None, help="Prompt text (tokenized with the model's tokenizer).")
@click.option("--tokens", default=None, help="Prompt as comma-separated token ids instead of text.")
@click.option("--chat", is_flag=True, help="Wrap --prompt as a user message in the model's chat template.")
@click.option("--max-tokens", "-n", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temp", "temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option("--repeat-penalty", default=1.0, show_default=True, type=float)
@click.option("--seed", default=None, type=int)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ctx-size", "-c", default=None, type=int, help="Context size (default: prompt + max tokens).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: tokens, text, timings (and spec).")
@click.option("--draft", "draft_path", default=None, type=click.Path(exists=True, path_type=Path),
              help="DFlash draft for speculative decoding: a dflash / qwen35-dflash-draft GGUF or a z-lab "
                   "directory (config.json + safetensors).")
@click.option("--draft-max", default=None, type=click.IntRange(min=0),
              help="Most draft tokens per step [draft block size - 1]; 0 = no speculation.")
@click.option("--draft-min", default=0, show_default=True, type=click.IntRange(min=0),
              help="Do not verify drafts shorter than this (after the margin cut).")
@click.option("--draft-margin", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0),
              help="Cut the draft before the first token whose top-1 - top-2 draft probability is below "
                   "this (dynamic draft length; 0 = off, ~0.3 is a good start).")
@_device_option
def generate(model_path: Path, prompt: str | None, tokens: str | None, chat: bool, max_tokens: int,
             temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
             seed: int | None, stop: tuple[str, ...], ctx_size: int | None, as_json: bool,
             draft_path: Path | None, draft_max: int | None, draft_min: int, draft_margin: float,
             device: str) -> None:
    """Generate a continuation of a prompt (speculatively with --draft: same tokens, fewer target steps)."""
    from daemons.architectures import load_model
    from daemons.generate import GenerationRequest, generate as run
    from daemons.sampling import SamplingParams
    from daemons.tokenizer import Tokenizer

    if (prompt is None) == (tokens is None):
        raise click.UsageError("give exactly one of --prompt and --tokens")
    model = load_model(str(model_path), device)
    speculative = None
    if draft_path is not None:
        from daemons.dflash import DFlashDraft, DFlashDrafter
        from daemons.speculative import SpecParams, SpeculativeDecoder
        params = SpecParams(draft_max=draft_max, draft_min=draft_min, draft_margin=draft_margin)
        draft = DFlashDraft.load(draft_path, model)
        speculative = SpeculativeDecoder(model, DFlashDrafter(draft), params)
    elif draft_max is not None or draft_min or draft_margin:
        raise click.UsageError("--draft-max, --draft-min and --draft-margin need --draft")
    tok = Tokenizer.from_metadata(model.metadata, source=str(model_path))
    if tokens is not None:
        ids = _parse_ids(tokens)
    else:
        text = prompt
        if chat:
            from daemons.chat_template import ChatTemplate
            tmpl = ChatTemplate.from_metadata(model.metadata)
            text = tmpl.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tok.encode(text, add_special=not chat, parse_special=chat)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, seed=seed)
    request = GenerationRequest(prompt_ids=tuple(ids), max_tokens=max_tokens, sampling=sampling,
                                stop_ids=tok.stop_ids, stop_strings=stop,
                                max_ctx=ctx_size or len(ids) + max_tokens + 1)
    out_ids: list[int] = []
    parts: list[str] = []
    final = None
    for ev in run(model, tok, request, speculative=speculative):
        out_ids.extend(ev.token_ids)
        parts.append(ev.text)
        if not as_json and ev.text:
            click.echo(ev.text, nl=False)
        if ev.is_final:
            final = ev
    if as_json:
        out = {"prompt_tokens": len(ids), "tokens": out_ids, "text": "".join(parts),
               "finish_reason": final.finish_reason, "timings": final.stats.to_dict()}
        if final.stats.spec is not None:
            out["spec"] = final.stats.spec
        click.echo(json.dumps(out, ensure_ascii=False))
    else:
        s = final.stats
        click.echo("")
        click.echo(f"[{final.finish_reason}] prompt {s.prompt_tokens} tok, {s.prefill_tok_s:.1f} tok/s; "
                   f"generated {s.generated_tokens} tok, {s.decode_tok_s:.1f} tok/s", err=True)
        if s.spec is not None:
            click.echo(f"[spec] drafted {s.spec['drafted']}, accepted {s.spec['accepted']}, "
                       f"{s.spec['steps']} verify steps, acceptance length {s.spec['acceptance_length']:.2f}",
                       err=True)


def default_model_paths() -> tuple[Path, Path | None] | None:
    """The embedded default target (and draft, if shipped) under models/, or None."""
    targets = sorted(MODELS_DIR.glob("*target*.gguf")) or sorted(
        p for p in MODELS_DIR.glob("*.gguf") if "draft" not in p.name)
    if not targets:
        return None
    drafts = sorted(MODELS_DIR.glob("*draft*.gguf"))
    return targets[0], (drafts[0] if drafts else None)


DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@main.command()
def demo() -> None:
    """Run the main job on the embedded default model, on the CPU."""
    paths = default_model_paths()
    if paths is None:
        click.echo("dflashd demo: no embedded default model is installed yet (models/ holds no GGUF "
                   "file; the trained default pair is a later milestone). Nothing was run.", err=True)
        sys.exit(1)
    target, draft = paths
    # The main job: `dflashd serve` on the embedded pair, one streamed chat request through the
    # HTTP listener, then its timings (router/demo.py).
    from router.demo import run_demo
    click.echo(f"dflashd demo: serving {target.name}" + (f" with draft {draft.name}" if draft else "")
               + " on the CPU", err=True)
    run_demo(target, draft, prompt=DEMO_PROMPT)


if __name__ == "__main__":
    main()
