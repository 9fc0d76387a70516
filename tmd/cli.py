"""The ``tmd`` command: a thin entry point; each verb hands off to its module."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import tmd
from tmd import config as config_mod
from tmd import log
from tmd.errors import ConfigError, TmdError

DEFAULT_CONFIG = "/etc/tmd/tmd.toml"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for prefix, own_parser in _OWN_PARSERS.items():
        if argv[: len(prefix)] == list(prefix):
            return own_parser(argv[len(prefix) :])
    args = _parser().parse_args(argv)
    try:
        return _VERBS[args.verb](args)
    except ConfigError as exc:
        print(f"tmd: config error: {exc}", file=sys.stderr)
        return 2
    except TmdError as exc:
        print(f"tmd: {exc}", file=sys.stderr)
        return 1


# -- verbs with their own argument parsers: they take the rest of the line untouched --


def _bench_ingest(argv: list[str]) -> int:
    from tmd.tools.bench import ingest

    return ingest.main(argv)


def _bench_detect(argv: list[str]) -> int:
    from tmd.tools.bench import detect

    return detect.main(argv)


def _bench_downtime(argv: list[str]) -> int:
    from tmd.tools.bench import downtime

    return int(downtime.main(argv))


def _bench_policy(argv: list[str]) -> int:
    from tmd.tools.bench import policy

    return policy.main(argv)


def _bench_faults(argv: list[str]) -> int:
    from tmd.tools.bench import faults

    return faults.main(argv)


def _sim(argv: list[str]) -> int:
    from tmd.sim import cli

    return cli.main(argv)


def _policy_train(argv: list[str]) -> int:
    from tmd.sim import train

    return train.main(argv)


def _launch(argv: list[str]) -> int:
    from tmd.runtime import launch

    return int(launch.main(argv))


def _store(argv: list[str]) -> int:
    from tmd.runtime import launch

    return launch.serve_store(argv)


_OWN_PARSERS: dict[tuple[str, ...], Callable[[list[str]], int]] = {
    ("bench", "ingest"): _bench_ingest,
    ("bench", "detect"): _bench_detect,
    ("bench", "downtime"): _bench_downtime,
    ("bench", "faults"): _bench_faults,
    ("bench", "policy"): _bench_policy,
    ("sim",): _sim,
    ("policy", "train"): _policy_train,
    ("launch",): _launch,
    ("store",): _store,
}


# -- the argument parser, one function per verb ------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tmd", description=tmd.__doc__)
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    _add_run(sub)
    _add_agent(sub)
    _add_check_config(sub)
    _add_queries(sub)
    _add_requests(sub)
    _add_demo(sub)
    sub.add_parser("version", help="print the version")
    benches = "ingest|detect|downtime|faults|policy"
    sub.add_parser("bench", help=f"benchmarks: `tmd bench {benches} --help`")
    sub.add_parser("sim", help="the daemon against a simulated cluster: `tmd sim --help`")
    sub.add_parser("policy", help="the learned policy: `tmd policy train --help`")
    sub.add_parser("launch", help="launch a local training job: `tmd launch --help`")
    sub.add_parser("store", help="serve a job's TCPStore for torchrun/srun: `tmd store --help`")
    return p


_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_run(sub: _Subparsers) -> None:
    run = sub.add_parser("run", help="run the head-node daemon")
    run.add_argument(
        "--config",
        help=f"TOML file (default: $TMD_CONFIG, else {DEFAULT_CONFIG} "
        "if it exists, else built-in defaults)",
    )


def _add_agent(sub: _Subparsers) -> None:
    agent = sub.add_parser("agent", help="run the node agent (NVML publisher)")
    agent.add_argument("--config", help="TOML file (default: as for `tmd run`)")
    agent.add_argument("--once", action="store_true", help="print one sample of every GPU, exit")
    agent.add_argument("--json", action="store_true", help="with --once: as JSON")


def _add_check_config(sub: _Subparsers) -> None:
    check = sub.add_parser("check-config", help="validate a config file and print it")
    check.add_argument("file")


def _add_queries(sub: _Subparsers) -> None:
    """``status`` and ``events``: read the daemon's API."""
    for name, text in (
        ("status", "show jobs, ranks, nodes and standbys"),
        ("events", "show findings, decisions and migrations"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument(
            "--api", help="daemon API base URL (default: from --config, else http://127.0.0.1:9464)"
        )
        q.add_argument("--config", help="read the API address from this config file")
        q.add_argument("--job", help="only this job")
        q.add_argument("--json", action="store_true", help="print the raw JSON")
        if name == "status":
            q.add_argument("--ranks", action="store_true", help="list every rank")
        else:
            q.add_argument("--kind", help="only events of this kind (e.g. NodeLost)")
            q.add_argument("--limit", type=int, default=50)


def _add_requests(sub: _Subparsers) -> None:
    """``drain`` and ``migrate``: ask the daemon, with its token."""
    for name, text in (
        ("drain", "move every job's work off a node (maintenance)"),
        ("migrate", "move one job's work off a node, optionally to a standby"),
    ):
        q = sub.add_parser(name, help=text)
        if name == "drain":
            q.add_argument("node")
        else:
            q.add_argument("--job", required=True)
            q.add_argument("--node", required=True)
            q.add_argument("--to", help="the standby to use (default: the actuator picks)")
        q.add_argument("--api", help="daemon API base URL (default: from --config)")
        q.add_argument("--config", help="read the API address and token from this config")
        q.add_argument(
            "--token-file",
            help="bearer token file (default: $TMD_API_TOKEN, "
            "else api.token / api.token_file of the config)",
        )
        q.add_argument("--by", default=os.environ.get("USER", ""), help="who asks (journaled)")


def _add_demo(sub: _Subparsers) -> None:
    demo = sub.add_parser("demo", help="a live migration of a slow machine, on this machine")
    demo.add_argument("--png", default="tmd-demo.png", help="where to write the timeline")
    demo.add_argument(
        "--slow-s", type=float, default=0.5, help="seconds the slow machine adds to each step"
    )
    demo.add_argument("--keep", help="keep the job's records and journal in this directory")
    demo.add_argument(
        "--embedded-broker",
        action="store_true",
        help="use the embedded broker even where mosquitto is installed",
    )


# -- the verbs ---------------------------------------------------------------------------


def _agent(args: argparse.Namespace) -> int:
    from tmd.agent import agent as agent_mod

    return agent_mod.run(_config_path(args.config), once=args.once, as_json=args.json)


def _check_config(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.file)
    _validate_plugins(cfg)
    print(json.dumps(config_mod.as_dict(cfg), indent=2, default=str))
    print(f"{args.file}: ok", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tmd.tools import demo as demo_mod

    return demo_mod.run(
        png=args.png, slow_s=args.slow_s, keep=args.keep, embedded_broker=args.embedded_broker
    )


def _version(args: argparse.Namespace) -> int:
    print(tmd.__version__)
    return 0


def _needs_subcommand(args: argparse.Namespace) -> int:
    print(f"tmd {args.verb}: needs a sub-command; see `tmd {args.verb} --help`", file=sys.stderr)
    return 2


def _config_path(given: str | None) -> str | None:
    path = given or os.environ.get("TMD_CONFIG")
    if path:
        return path
    return DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None


def _validate_plugins(cfg: config_mod.Config) -> None:
    from tmd.daemon.daemon import plugin_specs

    plugin_specs(cfg)


def _run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(_config_path(args.config))
    log.setup(level=cfg.log.level, format=cfg.log.format)
    from tmd.daemon.daemon import Daemon

    async def serve() -> None:
        daemon = Daemon(cfg)
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        await daemon.run()

    try:
        asyncio.run(serve())
    except asyncio.CancelledError:
        log.get("daemon").info("stopped")
        return 0
    return 1  # run() only returns by failing


# -- API clients -------------------------------------------------------------------------


def _api_base(args: argparse.Namespace) -> str:
    if args.api:
        return str(args.api).rstrip("/")
    api = config_mod.api_address(_config_path(args.config))
    host = "127.0.0.1" if api.host in ("0.0.0.0", "::", "") else api.host
    return f"http://{host}:{api.port}"


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.URLError as exc:
        raise TmdError(f"cannot reach the daemon at {url}: {exc.reason}") from None


def _token(args: argparse.Namespace) -> str:
    if args.token_file:
        with open(args.token_file) as f:
            return f.read().strip()
    if os.environ.get("TMD_API_TOKEN"):
        return os.environ["TMD_API_TOKEN"]
    from tmd.daemon.api import read_token

    return read_token(config_mod.api_address(_config_path(args.config)))


def _request(args: argparse.Namespace) -> int:
    if args.verb == "drain":
        path, body = "drain", {"node": args.node, "requested_by": args.by}
    else:
        path = "migrate"
        body = {"job": args.job, "node": args.node, "to": args.to, "requested_by": args.by}
    request = urllib.request.Request(
        f"{_api_base(args)}/api/v1/{path}",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {_token(args)}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            print(f"{args.verb}: accepted ({resp.status}); `tmd events` shows what was decided")
            return 0
    except urllib.error.HTTPError as exc:
        print(
            f"tmd {args.verb}: refused ({exc.code}): {exc.read().decode()[:500]}", file=sys.stderr
        )
        return 1
    except urllib.error.URLError as exc:
        raise TmdError(f"cannot reach the daemon: {exc.reason}") from None


def _status(args: argparse.Namespace) -> int:
    query = {"ranks": "1"}
    if args.job:
        query["job"] = args.job
    data = _get(f"{_api_base(args)}/api/v1/status?{urllib.parse.urlencode(query)}")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    from tmd.daemon.tables import render_status

    print(render_status(data, all_ranks=args.ranks))
    return 0


def _events(args: argparse.Namespace) -> int:
    query = {"limit": str(args.limit), "order": "desc"}
    if args.job:
        query["job"] = args.job
    if args.kind:
        query["kind"] = args.kind
    data = _get(f"{_api_base(args)}/api/v1/events?{urllib.parse.urlencode(query)}")
    rows = list(reversed(data["events"]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from tmd.daemon.tables import render_events

    print(render_events(rows))
    return 0


_VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run,
    "agent": _agent,
    "check-config": _check_config,
    "status": _status,
    "events": _events,
    "drain": _request,
    "migrate": _request,
    "demo": _demo,
    "version": _version,
    "bench": _needs_subcommand,  # `tmd bench` alone; its benchmarks have their own parsers
    "policy": _needs_subcommand,
}


if __name__ == "__main__":
    raise SystemExit(main())
