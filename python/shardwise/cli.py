"""Entry point of the ``shardwise`` command (implemented in Rust, ``src/cli.rs``)."""

import sys


def main(argv=None) -> None:
    from ._native import cli_main

    args = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.exit(cli_main(["shardwise", *args]))


if __name__ == "__main__":
    main()
