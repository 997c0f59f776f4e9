"""gradstore benchmarks: `python -m benchmarks.run` (see benchmarks/README.md).

Everything here measures; nothing here is imported by gradstore itself.
"""
