"""``python -m preprocess_service``: the command line (preprocess_service.service.cli)."""

from preprocess_service.service.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
