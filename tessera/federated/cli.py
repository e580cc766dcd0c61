"""`tessera fl server --config FILE`, `tessera fl client --server HOST:PORT --data FILE` and
`tessera fl token --client K`.

Run as `python -m tessera.federated server|client|token ...`; `add_subcommands` hangs the same
commands under another parser (`tessera fl ...`). The server's YAML config holds the fields of
`deployed.ServerConfig` plus `model` ("package.module:function" returning a fresh model),
`address` (default 127.0.0.1:8470), optional `certificate` / `private_key` (PEM paths: TLS; both
or neither) and `output` (where the final state dict is saved with `torch.save`). Its `token` is
the server's secret (or TESSERA_FL_SECRET); `tessera fl token --client K` prints client K's own
token from the same secret, for the operator to hand to that client. A client's `--data` is a
file written by `torch.save((inputs, labels))`, read with `weights_only=True` (tensors only, no
code); its `--token` (or TESSERA_FL_TOKEN) is its own token.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

__all__ = ["add_subcommands", "load_model_fn", "main"]


def load_model_fn(spec: str):
    """The callable named by "package.module:function" (it must return a fresh nn.Module)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"fl: model must be 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(module_name), attribute)


def _server(args: argparse.Namespace) -> int:
    import torch
    import yaml

    from tessera.federated.deployed import ServerConfig, serve

    settings = yaml.safe_load(Path(args.config).read_text()) or {}
    model_fn = load_model_fn(settings.pop("model", ""))
    address = settings.pop("address", "127.0.0.1:8470")
    certificate, private_key = settings.pop("certificate", None), settings.pop("private_key", None)
    output = settings.pop("output", None)
    settings.setdefault("token", os.environ.get("TESSERA_FL_SECRET", ""))
    if settings.get("dp") is not None:  # a mapping of DPConfig fields
        from tessera.federated.privacy import DPConfig

        settings["dp"] = DPConfig(**settings["dp"])
    if isinstance(settings.get("secure_aggregation"), dict):  # SecAggConfig fields (SecAgg+)
        from tessera.federated.secure_aggregation import SecAggConfig

        settings["secure_aggregation"] = SecAggConfig(**settings["secure_aggregation"])
    config = ServerConfig(**settings)
    server, grpc_server, port = serve(
        model_fn, config, address=address,
        certificate=Path(certificate).read_bytes() if certificate else None,
        private_key=Path(private_key).read_bytes() if private_key else None,
    )  # fmt: skip
    print(f"tessera fl server: listening on port {port}, {config.rounds} rounds", flush=True)
    try:
        history = server.run()
    finally:
        grpc_server.stop(grace=2)
    for index, (seconds, clients) in enumerate(zip(history.round_s, history.reported), 1):
        print(f"round {index}: {len(clients)} reports, {seconds * 1000:.0f} ms")
    if output:
        torch.save(history.state_dict, output)
    return 0


def _client(args: argparse.Namespace) -> int:
    import torch

    from tessera.federated.deployed import connect

    inputs, labels = torch.load(args.data, weights_only=True)
    token = args.token or os.environ.get("TESSERA_FL_TOKEN", "")
    root = Path(args.root_certificate).read_bytes() if args.root_certificate else None
    rounds = connect(
        args.server, load_model_fn(args.model), (inputs, labels), client=args.client,
        token=token, root_certificate=root, connect_timeout_s=args.connect_timeout,
        idle_timeout_s=args.idle_timeout,
    )  # fmt: skip
    print(f"tessera fl client {args.client}: trained in {rounds} rounds")
    return 0


def _token(args: argparse.Namespace) -> int:
    from tessera.federated.deployed import client_token

    secret = os.environ.get("TESSERA_FL_SECRET", "")
    if args.config:
        import yaml

        secret = (yaml.safe_load(Path(args.config).read_text()) or {}).get("token", secret)
    if not secret:
        raise ValueError("fl token: no secret (the server config's token, or TESSERA_FL_SECRET)")
    print(client_token(secret, args.client))
    return 0


def add_subcommands(commands) -> None:
    """Register `server`, `client` and `token` on an argparse subparsers object."""
    server = commands.add_parser("server", help="run a federated server (no data)")
    server.add_argument("--config", required=True, help="YAML: ServerConfig fields + model")
    server.set_defaults(handler=_server)
    client = commands.add_parser("client", help="train on local data for a federated server")
    client.add_argument("--server", required=True, help="HOST:PORT")
    client.add_argument("--data", required=True, help="torch.save((inputs, labels)) file")
    client.add_argument("--model", required=True, help="package.module:function")
    client.add_argument("--client", type=int, required=True, help="this client's id")
    client.add_argument("--token", default=None, help="this client's token (or TESSERA_FL_TOKEN)")
    client.add_argument("--root-certificate", default=None, help="PEM: use TLS")
    client.add_argument("--connect-timeout", type=float, default=30.0)
    client.add_argument("--idle-timeout", type=float, default=900.0, help="give up after")
    client.set_defaults(handler=_client)
    token = commands.add_parser("token", help="print a client's token (for the operator)")
    token.add_argument("--client", type=int, required=True, help="the client's id")
    token.add_argument("--config", default=None, help="the server's YAML (its token: the secret)")
    token.set_defaults(handler=_token)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m tessera.federated`."""
    parser = argparse.ArgumentParser(
        prog="tessera fl", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)
