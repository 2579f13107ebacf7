"""`flashdraft serve`: llama-server's flags, so a llama-server DFlash command line works with only the program
name changed. Flags that tune llama.cpp's own backends (GPU offload, batch sizes, cache types, mmap, ...) are
accepted and named once in a startup warning as having no effect; an unknown flag is an error naming it."""
from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

from flashdraft.cli import (add_cache_args, add_hub_refusals, add_sampling_args, cache_args_from_args,
                           resolve_model_paths)
from flashdraft.config import ConfigError, is_gguf_path
from flashdraft.server.chat_templates import BUILTIN_TEMPLATES, resolve_chat_template
from flashdraft.server.formats import REASONING_FORMATS
from flashdraft.server.settings import ServerSettings

log = logging.getLogger("flashdraft.server")

# llama.cpp flags with no effect here, by how many values they take. Aliases are grouped per flag.
NO_EFFECT_WITH_VALUE = [
    ("-ngl", "--gpu-layers", "--n-gpu-layers"), ("-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft"),
    ("-b", "--batch-size"),
    ("--spec-draft-p-min", "--draft-p-min"),
    ("--spec-draft-p-split",), ("--spec-branch-budget",), ("--tree-budget",), ("--spec-draft-top-k",),
    ("--spec-draft-temp",), ("--spec-dflash-max-slots",), ("--spec-draft-batch-size",), ("--spec-draft-ubatch-size",),
    ("--spec-dm-probe-interval",), ("--spec-dm-probe-fraction",),
    ("--spec-dm-explore-interval",), ("--spec-dm-off-dwell",), ("--spec-dm-fringe-min",), ("--spec-dm-fringe-max",),
    ("--spec-dm-min-reach",), ("--spec-dm-profit-min",), ("--spec-dm-profit-raise-margin",),
    ("--spec-dm-profit-lower-margin",), ("--spec-dm-profit-ewma-alpha",), ("--spec-dm-profit-min-samples",),
    ("--spec-dm-profit-warmup",), ("--spec-dm-profit-baseline-interval",),
    ("-tb", "--threads-batch"), ("-td", "--threads-draft"), ("--numa",), ("-sm", "--split-mode"),
    ("-ts", "--tensor-split"), ("-mg", "--main-gpu"), ("-ot", "--override-tensor"), ("-ncmoe", "--n-cpu-moe"),
    ("-devd", "--device-draft"), ("-ctxcp", "--ctx-checkpoints"), ("-dt", "--defrag-thold"),
    ("-to", "--timeout"), ("--threads-http",), ("--path",), ("--prio",), ("--poll",),
    ("-C", "--cpu-mask"),
    ("--log-file",), ("-lv", "--verbosity", "--log-verbosity"), ("--sleep-idle-seconds",),
]
NO_EFFECT_OPTIONAL_VALUE = [("-fa", "--flash-attn"), ("--log-colors",), ("-fit", "--fit")]
NO_EFFECT_BARE = [
    ("--no-mmap",), ("--mmap",), ("--mlock",), ("--no-host",), ("-kvu", "--kv-unified"), ("--no-kv-unified",),
    ("--log-timestamps",), ("--log-prefix",), ("--no-jinja",), ("-cb", "--cont-batching"),
    ("-nocb", "--no-cont-batching"), ("--swa-full",), ("-cmoe", "--cpu-moe"),
    ("--slots",), ("--no-slots",), ("--props",), ("-v", "--verbose"),
    ("--log-disable",), ("-nkvo", "--no-kv-offload"), ("--no-op-offload",),
    ("--no-perf",), ("--check-tensors",),
]
SPEC_TYPES = ("dflash", "draft-dflash", "ngram", "ngram-simple", "dflash+ngram", "none")
NGRAM_TYPES = ("ngram", "ngram-simple")  # n-gram lookup in the text itself (llama.cpp's name is the second)
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?|CUDA\d+|none)$")


class _NoEffect(argparse.Action):
    """Records the flag (and its value) for the startup warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        shown = option_string if values in (None, []) else f"{option_string} {values}"
        namespace.no_effect = [*getattr(namespace, "no_effect", []), shown]


def build_parser() -> argparse.ArgumentParser:
    every = [f for group in NO_EFFECT_WITH_VALUE + NO_EFFECT_OPTIONAL_VALUE + NO_EFFECT_BARE for f in group]
    epilog = textwrap.fill("Accepted for llama-server compatibility, with no effect (named in a startup warning): "
                           + " ".join(every), 79, break_on_hyphens=False)
    p = argparse.ArgumentParser(
        prog="flashdraft serve", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI- and llama-server-compatible HTTP server with DFlash speculative decoding and a web "
                    "chat page. Flags are spelled as llama-server's.",
        epilog=epilog)
    p.add_argument("-m", "--model", default=None, help="target model folder (default: the embedded demo model)")
    p.add_argument("-md", "--spec-draft-model", "--model-draft", dest="drafter", default=None,
                   help="DFlash drafter folder (default with no -m: the demo drafter)")
    p.add_argument("--spec-type", choices=SPEC_TYPES, default=None,
                   help="dflash (or draft-dflash): draft with the drafter; ngram (or ngram-simple): n-gram lookup "
                        "in the text itself, no drafter; dflash+ngram: both, the lookup's proposal where it is long "
                        "or the drafter is off (agents quoting earlier turns; not pipelined on a GPU); none: plain "
                        "decoding. Default: dflash when a drafter is given")
    p.add_argument("--spec-draft-n-max", "--draft-max", "--draft-n", "--draft", dest="spec_n_max", type=int,
                   default=None, help="longest draft per step (default: the drafter's block size - 1)")
    p.add_argument("--spec-draft-n-min", "--draft-min", dest="spec_n_min", type=int, default=0,
                   help="shorter drafts are skipped (plain step instead); default 0")
    p.add_argument("--no-spec-dm-adaptive", dest="adaptive", action="store_false",
                   help="draft the full n_max on every step instead of the adaptive draft-length controller")
    p.add_argument("--spec-dm-controller", choices=("profit", "fringe", "off"), default="profit",
                   help="off = --no-spec-dm-adaptive; profit and fringe both select the adaptive controller")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size in tokens (0 = the model's, capped at 8192)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests generated at once (default 1)")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="when a generation fills the context, drop the older half of the tokens after the kept ones "
                        "and go on (default off, as llama-server)")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false")
    p.add_argument("--warmup", dest="warmup", action="store_true", default=True,
                   help="at load, run a short generation on each slot so the first request finds the compiled "
                        "layers and CUDA graphs made (default on, as llama-server; only where there are any)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="prompt tokens a context shift keeps (default 0, -1 all); requests may set n_keep")
    p.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="llama-server's reuse of cached chunks by KV shifting: only 0 (off, its default) is "
                        "supported; the prompt cache reuses exact prefixes (cache_prompt, --cache-ram)")
    p.add_argument("-cram", "--cache-ram", type=int, default=8192, metavar="MiB",
                   help="host memory for the prompt prefixes slots evict, brought back when a prompt shares more "
                        "with one than with any slot (default 8192, 0 off, -1 no limit)")
    add_sampling_args(p)
    p.add_argument("-s", dest="seed", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("-a", "--alias", default=None,
                   help="model name in /v1/models and responses (default: the model's: its folder or GGUF name)")
    p.add_argument("--api-key", action="append", default=[],
                   help="require this API key (comma-separated list or repeated flag)")
    p.add_argument("--api-key-file", default=None, help="file with one API key per line")
    p.add_argument("--metrics", action="store_true", help="enable GET /metrics (Prometheus)")
    p.add_argument("--jinja", action="store_true", help="use the model's Jinja chat template (always on)")
    p.add_argument("--chat-template", default=None,
                   help="chat template to use instead of the model's: a built-in's name ("
                        + ", ".join(BUILTIN_TEMPLATES) + ") or a Jinja template")
    p.add_argument("--chat-template-file", default=None, help="Jinja chat template to use instead of the model's")
    p.add_argument("--allow-request-chat-template", action="store_true",
                   help="let requests send their own chat template (chat_template, or chat_template_kwargs."
                        "chat_template), rendered in a sandboxed helper process with a time and memory limit; "
                        "default: refused with 400")
    p.add_argument("-rea", "--reasoning", choices=("on", "off", "auto"), default="auto",
                   help="off: chat templates get enable_thinking=false (Qwen3, Gemma 4: no thinking, Gemma's empty "
                        "thought channel); on: true; auto (default): the template's own default")
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                   help="deepseek or auto (default): a thinking model's reasoning goes to reasoning_content, out of "
                        "content (Qwen3 <think>, Gemma 4's thought channel); none: it stays in content")
    p.add_argument("--reasoning-budget", type=int, default=-1,
                   help="-1 (default): unlimited thinking; 0: no thinking (as --reasoning off)")
    p.add_argument("--webui", dest="webui", action="store_true", default=True, help="serve the web chat page at / (default)")
    p.add_argument("--no-webui", dest="webui", action="store_false", help="do not serve the web chat page")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--device", "-dev", default=None,
                   help="cpu, cuda or cuda:N (llama.cpp's CUDA0 and none are understood); default cuda if available")
    add_cache_args(p)
    add_hub_refusals(p)
    for group in NO_EFFECT_WITH_VALUE:
        p.add_argument(*group, action=_NoEffect, dest="no_effect", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    for group in NO_EFFECT_OPTIONAL_VALUE:
        p.add_argument(*group, action=_NoEffect, nargs="?", dest="no_effect", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    for group in NO_EFFECT_BARE:
        p.add_argument(*group, action=_NoEffect, nargs=0, dest="no_effect", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    return p


def settings_from_args(args) -> ServerSettings:
    """Checked settings; raises ValueError / ConfigError naming the flag at fault."""
    checks = [(0 <= args.port <= 65535, f"--port must be in 0..65535, got {args.port}"),
              (args.parallel >= 1, f"-np/--parallel must be >= 1, got {args.parallel}"),
              (args.ctx_size >= 0, f"-c/--ctx-size must be >= 0, got {args.ctx_size}"),
              (args.n_predict >= 1 or args.n_predict == -1, f"-n/--n-predict must be >= 1 or -1, got {args.n_predict}"),
              (args.spec_n_max is None or args.spec_n_max >= 0, f"--spec-draft-n-max must be >= 0, got {args.spec_n_max}"),
              (args.spec_n_min >= 0, f"--spec-draft-n-min must be >= 0, got {args.spec_n_min}"),
              (args.threads is None or args.threads >= 1, f"-t/--threads must be >= 1, got {args.threads}"),
              (args.cache_reuse == 0, f"--cache-reuse {args.cache_reuse}: reusing cached chunks by KV shifting is "
                                      "not supported (only 0, off); the prompt cache reuses exact prefixes of the "
                                      "prompt (cache_prompt, --cache-ram)"),
              (args.keep >= -1, f"--keep must be -1 (all of the prompt) or >= 0, got {args.keep}"),
              (args.cache_ram >= -1, f"-cram/--cache-ram must be -1 (no limit), 0 (off) or MiB, got {args.cache_ram}"),
              (args.device is None or DEVICE.match(args.device), f"--device must be cpu, cuda or cuda:N, got {args.device!r}"),
              (args.reasoning_budget in (-1, 0), f"--reasoning-budget must be -1 (unlimited) or 0 (no thinking): "
                                                 f"other budgets are not supported, got {args.reasoning_budget}"),
              (not (args.reasoning_budget == 0 and args.reasoning == "on"),
               "--reasoning-budget 0 turns thinking off, which contradicts --reasoning on"),
              (not (args.chat_template and args.chat_template_file),
               "--chat-template and --chat-template-file cannot both be given")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    drafting = args.spec_type != "none"
    lookup_only = args.spec_type in NGRAM_TYPES
    ngram = lookup_only or args.spec_type == "dflash+ngram"
    if lookup_only and args.drafter:
        raise ConfigError(f"--spec-type {args.spec_type} drafts by lookup in the text itself, with no drafter "
                          "model: drop -md (or --spec-type dflash+ngram for both)")
    model, drafter = resolve_model_paths(args.model, args.drafter, draft=drafting and not lookup_only)
    for folder, flag in ((model, "-m"), (drafter, "-md")):
        if folder is None:
            continue
        if is_gguf_path(folder):
            if not Path(folder).is_file():
                raise ConfigError(f"{flag} {folder}: GGUF file not found")
        elif not (Path(folder) / "config.json").is_file():
            raise ConfigError(f"{flag} {folder}: not a model folder (no config.json there) nor a .gguf file")
    if args.spec_type in ("dflash", "draft-dflash", "dflash+ngram") and drafter is None:
        raise ConfigError(f"--spec-type {args.spec_type} needs a drafter: pass -md DRAFTER_FOLDER")
    keys = [k.strip() for arg in args.api_key for k in arg.split(",") if k.strip()]
    if args.api_key_file:
        keys += [line.strip() for line in Path(args.api_key_file).read_text().splitlines() if line.strip()]
    template = Path(args.chat_template_file).read_text() if args.chat_template_file else None
    if args.chat_template:
        template = resolve_chat_template(args.chat_template)
    device = args.device
    if device == "none":
        device = "cpu"
    elif device and device.startswith("CUDA"):
        device = f"cuda:{device[4:]}"
    settings = ServerSettings(
        model=str(model), drafter=str(drafter) if drafter else None, alias=args.alias,
        host=args.host, port=args.port, ctx_size=args.ctx_size or None, n_slots=args.parallel,
        drafting=drafter is not None or ngram, ngram=ngram, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.seed if args.seed is None or args.seed >= 0 else None,
        n_predict=args.n_predict, spec_n_max=args.spec_n_max, spec_n_min=args.spec_n_min,
        adaptive_draft=args.adaptive and args.spec_dm_controller != "off", api_keys=keys,
        metrics=args.metrics, webui=args.webui, chat_template=template, device=device, threads=args.threads,
        reasoning=args.reasoning, reasoning_format=args.reasoning_format, reasoning_budget=args.reasoning_budget,
        allow_request_template=args.allow_request_chat_template,
        cache_options=cache_args_from_args(args, drafter is not None), cache_ram_mib=args.cache_ram,
        context_shift=args.context_shift, keep=args.keep, warmup=args.warmup)
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse has printed the error (naming the flag) or the help
        return int(e.code or 0)
    try:
        settings = settings_from_args(args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"flashdraft serve: error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    no_effect = getattr(args, "no_effect", [])
    if no_effect:
        log.warning("these llama-server flags tune llama.cpp's own backends and have no effect here: %s",
                    ", ".join(no_effect))
    return serve(settings)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is logged: a port in use is an error naming it, not a
    "listening on" line followed by a traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets that say so (40 ms a response else).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def make_server(state):
    """uvicorn over the app; its exit (SIGINT, SIGTERM) first stops the worker, so open streams end at once
    instead of running to completion."""
    import uvicorn

    from flashdraft.server.app import create_app

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            log.info("shutting down")
            state.close()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(state), log_config=None, access_log=False, timeout_graceful_shutdown=5,
                            server_header=False)
    return Server(config)


def serve_in_thread(state) -> tuple[object, str]:
    """The app over a loaded state on a free loopback port, in a daemon thread of this process (measurement
    scripts); returns the uvicorn server (handle_exit stops it) and its base URL, once it accepts connections."""
    sock = bind("127.0.0.1", 0)
    server = make_server(state)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def serve(settings: ServerSettings) -> int:
    from flashdraft.server.app import ServerState, start_loading

    try:
        sock = bind(settings.host, settings.port)
    except OSError as e:
        print(f"flashdraft serve: error: cannot listen on {settings.host}:{settings.port}: "
              f"{e.strerror or e} (--port picks another port)", file=sys.stderr)
        return 1
    state = ServerState(settings)
    server = make_server(state)
    # uvicorn re-raises the signal that stopped it once it is done; these handlers make that a clean exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    log.info("listening on http://%s:%d (model loading in the background)", settings.host, settings.port)
    start_loading(state, on_failure=lambda: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        state.close()
        sock.close()
    if state.scheduler is not None:
        state.scheduler.join(5)
    if state.load_error is not None:
        return 1
    log.info("server stopped")
    return 0
