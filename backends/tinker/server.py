"""The Tinker API server process: ``python -m backends.tinker.server --config server.json``.

``server.json`` holds ``backends.tinker.service.ServerConfig``'s fields plus ``host`` and
``port`` (``skyrl tinker serve`` writes it into the run directory; API keys are not written there:
they come from the environment variable named by ``api_keys_env``, comma-separated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import uvicorn

from backends.tinker.app import create_app
from backends.tinker.service import ServerConfig, TinkerService
from skyrl_contracts.logs import setup_process_logging


def load_config(path: str):
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    host, port = raw.pop("host", "127.0.0.1"), int(raw.pop("port", 8000))
    keys = set(raw.pop("api_keys", []))
    env_name = raw.pop("api_keys_env", None)
    if env_name and os.environ.get(env_name):
        keys |= {k.strip() for k in os.environ[env_name].split(",") if k.strip()}
    if not keys:
        raise SystemExit("tinker server: no API keys configured (tinker.api_keys or the api_keys_env variable)")
    raw["engine_urls"] = tuple(raw.get("engine_urls", ()))
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = set(raw) - names
    if unknown:
        raise SystemExit(f"tinker server: unknown config keys {sorted(unknown)}")
    return ServerConfig(api_keys=frozenset(keys), **raw), host, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="backends.tinker.server")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    setup_process_logging()
    config, host, port = load_config(args.config)

    service = TinkerService(config)
    service.start()
    service.scheduler.ready.wait()
    if service.scheduler.failed is not None:
        print(f"tinker server: the trainer failed to start: {service.scheduler.failed}", file=sys.stderr)
        return 1
    app = create_app(service)
    logging.getLogger(__name__).info("tinker API on http://%s:%d serving %s", host, port, config.base_model)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
