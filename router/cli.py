"""`dflashd serve` (router + local workers) and `dflashd router` (router alone).

    dflashd serve --config dflashd.toml
    dflashd serve --model M.gguf [--draft D.gguf [--draft-max N] [--draft-min N] [--draft-margin P]]
                  [--device cuda:0 --device hip:0 | --workers N]
                  [--host H] [--port P] [--ctx-size N] [--alias NAME] [--api-key K | --api-key-file F]
    dflashd router --bind tcp://0.0.0.0:5555 [--model M.gguf ...] [--host H] [--port P]

Flags override the config file.  The listener's address is printed on stderr as
`dflashd: listening on http://HOST:PORT` once it accepts connections, then `dflashd: ready: MODELS`
(and `; failed: MODELS`) once every configured model has a ready worker or was given up.  Under
systemd (`Type=notify`), READY=1 is sent at that point (when at least one model is ready); STATUS=
lines say what it waits for.  With LISTEN_FDS (socket activation) the inherited
socket is used instead of binding one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

import click

from router.config import (
    DEFAULT_PORT,
    Config,
    ConfigError,
    ModelSpec,
    WorkerSpec,
    check_draft_options,
    check_endpoint,
    check_model_id,
    check_unique_names,
    load_config,
    parse_device,
    read_api_key_file,
)

log = logging.getLogger("dflashd.router")
EXIT_USER_ERROR = 2
SD_LISTEN_FDS_START = 3


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to systemd's notify socket, if there is one."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify(%s) failed: %s", state.split("\n")[0], e)
        return False


def _fail(message: str) -> None:
    click.echo(f"dflashd: error: {message}", err=True)
    sys.exit(EXIT_USER_ERROR)


def _listener(host: str, port: int) -> socket.socket:
    if os.environ.get("LISTEN_PID") == str(os.getpid()) and int(os.environ.get("LISTEN_FDS", "0")) >= 1:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
        sock.setblocking(False)
        return sock
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it a keep-alive client waits out a 40 ms delayed ACK between headers and body.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die of
        the signal; an orderly stop (workers down, sockets closed) exits with status 0 instead."""

        stop_signal: int | None = None

        def handle_exit(self, sig, frame) -> None:
            self.stop_signal = sig
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return Server


def run_server(config: Config, *, supervise: bool) -> None:
    """Build the service (reads model metadata: bad files fail here, as user errors) and serve
    until SIGINT/SIGTERM; local workers go down with it."""
    import uvicorn

    from router.app import RouterService, create_app
    _Server = _server_class()

    service = RouterService(config, supervise=supervise)
    app = create_app(service, manage_service=False)
    s = config.server
    sock = _listener(s.host, s.port)
    host, port = sock.getsockname()[:2]
    uv_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                               timeout_graceful_shutdown=5, timeout_keep_alive=30)
    server = _Server(uv_config)

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"dflashd: listening on http://{shown}:{port} (workers join at {service.hub.endpoint})", err=True)
        sup = service.supervisor
        if sup is None:
            sd_notify("READY=1\nSTATUS=listening; waiting for workers to join")
            return
        sd_notify("STATUS=listening; loading models")
        while not sup.settled:
            if server.should_exit:
                return
            await asyncio.sleep(0.1)
        states = sup.model_states()
        ready = [m for m, v in states.items() if v == "ready"]
        failed = [m for m, v in states.items() if v == "failed"]
        line = f"ready: {', '.join(ready) or 'no model'}" + (f"; failed: {', '.join(failed)}" if failed else "")
        click.echo(f"dflashd: {line}", err=True)
        if ready:
            sd_notify(f"READY=1\nSTATUS=serving; {line}")
        else:
            sd_notify(f"STATUS=no model could be loaded; {line}")

    async def main() -> None:
        await service.start()  # binds the worker socket: a bad --bind fails here, before serving
        task = asyncio.ensure_future(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            sd_notify("STOPPING=1")
            task.cancel()
            await service.stop()  # after the HTTP side drained: workers go down last
            if server.stop_signal is not None:
                click.echo(f"dflashd: stopped ({signal.Signals(server.stop_signal).name})", err=True)

    try:
        asyncio.run(main())
    finally:
        sock.close()


def _logging(verbose: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s [router] %(levelname)s %(message)s")


def _common_options(f):
    options = [
        click.option("--host", default=None, help="HTTP listen address [config, else 127.0.0.1]."),
        click.option("--port", type=click.IntRange(0, 65535), default=None,
                     help=f"HTTP port; 0 picks a free one [config, else {DEFAULT_PORT}]."),
        click.option("--api-key", "api_keys", multiple=True,
                     help="Require this API key (Authorization: Bearer KEY or x-api-key); repeatable."),
        click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="File with API keys, one per line."),
        click.option("--n-predict", "-n", type=int, default=None,
                     help="Cap on completion tokens per request (-1 = none)."),
        click.option("--log-prompts", is_flag=True, default=None,
                     help="Log prompt text (debugging only; off by default)."),
        click.option("--timeout", "admission_timeout", type=click.FloatRange(min=0.001), default=None,
                     help="Seconds a request may wait for a free worker [30]."),
        click.option("--verbose", "-v", is_flag=True, help="Debug logging."),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def _apply_common(cfg: Config, host, port, api_keys, api_key_file, n_predict, log_prompts,
                  admission_timeout) -> Config:
    changes = {}
    if host is not None:
        changes["host"] = host
    if port is not None:
        changes["port"] = port
    keys = tuple(api_keys)
    if api_key_file is not None:
        keys += read_api_key_file(api_key_file)
    if keys:
        for k in keys:
            if not k or any(c.isspace() for c in k) or not k.isprintable():
                raise ConfigError("an API key must be printable text without spaces")
        changes["api_keys"] = keys
    if n_predict is not None:
        if n_predict < -1 or n_predict == 0:
            raise ConfigError(f"--n-predict must be -1 or >= 1, got {n_predict}")
        changes["n_predict"] = n_predict
    if log_prompts:
        changes["log_prompts"] = True
    if admission_timeout is not None:
        changes["admission_timeout_s"] = admission_timeout
    return cfg.with_server(**changes) if changes else cfg


def _model_from_flags(path: Path, draft: Path | None, alias: str | None, ctx_size: int | None,
                      devices: tuple[str, ...], n_workers: int | None, draft_max: int | None = None,
                      draft_min: int | None = None, draft_margin: float | None = None) -> ModelSpec:
    if not path.is_file():
        raise ConfigError(f"--model: no such file {path}")
    if draft is not None and not (draft.is_file() or (draft.is_dir() and (draft / "config.json").is_file())):
        raise ConfigError(f"--draft: no draft at {draft} (a GGUF file or a directory holding config.json)")
    if draft is None and any(v is not None for v in (draft_max, draft_min, draft_margin)):
        raise ConfigError("--draft-max, --draft-min and --draft-margin need --draft")
    if draft_max is not None and draft_min is not None and draft_min > draft_max:
        raise ConfigError(f"--draft-min {draft_min} exceeds --draft-max {draft_max}")
    draft_max, draft_min, draft_margin = check_draft_options(draft, draft_max, draft_min, draft_margin)
    for d in devices:
        parse_device(d)
    if devices and n_workers is not None and n_workers != len(devices):
        raise ConfigError(f"--workers {n_workers} disagrees with {len(devices)} --device value(s)")
    if devices:
        workers = tuple(WorkerSpec(device=d) for d in devices)
    else:
        workers = tuple(WorkerSpec() for _ in range(n_workers if n_workers is not None else 1))
    model_id = check_model_id(alias or path.stem, "--alias")
    return ModelSpec(id=model_id, path=path.resolve(), draft=draft.resolve() if draft else None, draft_max=draft_max,
                     draft_min=draft_min, draft_margin=draft_margin, ctx_size=ctx_size, workers=workers)


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TOML file with [server] and [[models]] (see router/config.py).")
@click.option("--model", "-m", "model_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Serve this GGUF model (instead of, or added to, the config's models).")
@click.option("--draft", "--model-draft", "-md", "draft_path", type=click.Path(path_type=Path),
              default=None, help="DFlash draft for --model: a dflash / qwen35-dflash-draft GGUF or a z-lab directory.")
@click.option("--draft-max", "--draft-n", "draft_max", type=click.IntRange(0, 256), default=None,
              help="Most draft tokens per step for --model's workers [draft block size - 1]; 0 = no speculation.")
@click.option("--draft-min", "--draft-n-min", "draft_min", type=click.IntRange(0, 256), default=None,
              help="Do not verify drafts shorter than this [0].")
@click.option("--draft-margin", type=click.FloatRange(0.0, 1.0), default=None,
              help="Cut drafts at the first token whose top-1 - top-2 draft probability is below this [0 = off].")
@click.option("--alias", "-a", default=None, help="Name clients use for --model [file name].")
@click.option("--device", "devices", multiple=True, help="cpu, cuda:N or hip:N; one worker per --device.")
@click.option("--workers", "n_workers", type=click.IntRange(1, 64), default=None,
              help="Number of workers for --model (on --device cpu unless --device is given).")
@click.option("--ctx-size", "-c", type=click.IntRange(1, 1 << 24), default=None, help="Context length per worker.")
@click.option("--bind", default=None, help="ZeroMQ endpoint workers join [tcp://127.0.0.1:0].")
@_common_options
def serve(config_path, model_path, draft_path, draft_max, draft_min, draft_margin, alias, devices, n_workers, ctx_size,
          bind, host, port, api_keys, api_key_file, n_predict, log_prompts, admission_timeout, verbose) -> None:
    """Run the router and the local workers of a config (or of one --model)."""
    from daemons.gguf_reader import GGUFError
    from daemons.tokenizer import TokenizerError
    _logging(verbose)
    try:
        cfg = load_config(config_path) if config_path is not None else Config()
        if model_path is not None:
            cfg = replace(cfg, models=cfg.models + (_model_from_flags(model_path, draft_path, alias, ctx_size,
                                                                       devices, n_workers, draft_max, draft_min,
                                                                       draft_margin),))
        elif any(v is not None and v != () for v in (draft_path, alias, devices, n_workers, ctx_size, draft_max,
                                                       draft_min, draft_margin)):
            raise ConfigError("--draft, --draft-max/-min/-margin, --alias, --device, --workers and --ctx-size "
                              "describe --model; give --model")
        if not cfg.models:
            raise ConfigError("nothing to serve: give --config FILE.toml or --model M.gguf")
        check_unique_names(cfg.models)
        if bind is not None:
            cfg = cfg.with_server(bind=check_endpoint(bind, "--bind"))
        cfg = _apply_common(cfg, host, port, api_keys, api_key_file, n_predict, log_prompts, admission_timeout)
        run_server(cfg, supervise=True)
    except (ConfigError, GGUFError, TokenizerError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(str(e))


@click.command("router", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bind", default=None,
              help="ZeroMQ endpoint for workers started elsewhere (dflashd worker --connect ...) "
                   "[config, else tcp://127.0.0.1:5555].")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TOML config; its [[models]] give the model files (their workers are NOT started here).")
@click.option("--model", "-m", "model_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="A model file the remote workers serve (the router reads its chat template and "
                   "tokenizer); repeatable; NAME=PATH sets the name.")
@_common_options
def router(bind, config_path, model_paths, host, port, api_keys, api_key_file, n_predict, log_prompts,
           admission_timeout, verbose) -> None:
    """Run the router alone, for workers that join from elsewhere."""
    from daemons.gguf_reader import GGUFError
    from daemons.tokenizer import TokenizerError
    _logging(verbose)
    try:
        cfg = load_config(config_path) if config_path is not None else Config()
        models = list(cfg.models)
        for raw in model_paths:
            name, _, p = str(raw).rpartition("=") if "=" in str(raw) else ("", "", str(raw))
            path = Path(p)
            if not path.is_file():
                raise ConfigError(f"--model: no such file {path}")
            models.append(ModelSpec(id=check_model_id(name or path.stem, "--model NAME"), path=path.resolve()))
        check_unique_names(tuple(models))
        cfg = replace(cfg, models=tuple(replace(m, workers=()) for m in models))
        if bind is None and config_path is None:
            bind = "tcp://127.0.0.1:5555"
        if bind is not None:
            cfg = cfg.with_server(bind=check_endpoint(bind, "--bind"))
        cfg = _apply_common(cfg, host, port, api_keys, api_key_file, n_predict, log_prompts, admission_timeout)
        run_server(cfg, supervise=False)
    except (ConfigError, GGUFError, TokenizerError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(str(e))
