"""``kvsan fuzz``: coverage-guided search (Atheris over vLLM's
``vllm/v1/core``) for KV-cache lifetime bugs, with kvsan's invariants as the
oracle (docs/fuzzing.md)."""
