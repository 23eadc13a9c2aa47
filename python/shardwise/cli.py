"""Entry point of the ``shardwise`` command (implemented in Rust, ``crates/shardwise-cli/src/lib.rs``)."""

import os
import sys


def main(argv=None) -> None:
    """Runs ``shardwise`` with ``argv`` (default ``sys.argv[1:]``; ``str``, ``bytes`` or path
    objects, so non-UTF-8 paths work) and exits with its code (141 when stdout was closed early)."""
    from ._native import cli_main

    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.exit(cli_main(["shardwise", *(os.fsdecode(a) for a in args)]))


if __name__ == "__main__":
    main()
