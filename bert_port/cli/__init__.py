"""Command-line entry points. Each `main(argv=None) -> int` is a console script; the
modules that compare against `transformers` import it inside `main()` only."""
