"""`python -m gradstore ...`: the same command line as the `gradstore` script (gradstore.cli.main)."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="gradstore")
