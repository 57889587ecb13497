"""Run the operator: `python -m rayzero_operator [--namespace NS ...] [--liveness URL]`.

Runs standalone (no kopf peering): the Helm chart deploys one replica with the Recreate strategy,
so two operators never reconcile at once — and if they ever did, deterministic RayJob names keep
each attempt to one RayJob ([Note: one RayJob per attempt]).
"""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayzero_operator", description=__doc__.split("\n")[0])
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--liveness", default=None,
                        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)

    import kopf

    import rayzero_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, log_prefix=False)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0


if __name__ == "__main__":
    sys.exit(main())
