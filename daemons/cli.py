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
    from daemons.gguf_reader import GGUFError
    errors: list[type[BaseException]] = [GGUFError]
    for module, name in (("daemons.tokenizer", "TokenizerError"),
                         ("daemons.chat_template", "ChatTemplateError"),
                         ("daemons.convert", "ConvertError"),
                         ("kernels.backend", "BackendError"),
                         ("kernels.ggml_quants", "UnsupportedQuantType")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


class _Group(click.Group):
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
    from daemons.model_info import describe, format_human
    with GGUFFile(file) as g:
        info = describe(g, with_metadata=as_json)
    if as_json:
        click.echo(json.dumps(info, ensure_ascii=False, default=str))
    else:
        click.echo(format_human(info))


def default_model_paths() -> tuple[Path, Path | None] | None:
    """The embedded default target (and draft, if shipped) under models/, or None."""
    targets = sorted(MODELS_DIR.glob("*target*.gguf")) or sorted(
        p for p in MODELS_DIR.glob("*.gguf") if "draft" not in p.name)
    if not targets:
        return None
    drafts = sorted(MODELS_DIR.glob("*draft*.gguf"))
    return targets[0], (drafts[0] if drafts else None)


@main.command()
def demo() -> None:
    """Run the main job on the embedded default model, on the CPU."""
    paths = default_model_paths()
    if paths is None:
        click.echo("dflashd demo: no embedded default model is installed yet (models/ holds no GGUF "
                   "file; the trained default pair is a later milestone). Nothing was run.", err=True)
        sys.exit(1)
    target, draft = paths
    from daemons.demo import run_demo
    run_demo(target, draft)


if __name__ == "__main__":
    main()
