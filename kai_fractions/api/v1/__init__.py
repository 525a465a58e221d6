"""Generated kai_fractions.v1 API (scripts/gen-protos from protos/; do not edit)."""
