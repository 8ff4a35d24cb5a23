"""YAML workloads: schema, run store, background supervisor and the CLI commands."""
