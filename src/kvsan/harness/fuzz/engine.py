"""The engine target (placeholder until built): see docs/fuzzing.md."""


def unavailable() -> str | None:
    return ("--target engine is not built yet in this kvsan; use --target scheduler "
            "(docs/fuzzing.md)")
