"""YAML workloads: schema, submission, the background supervisor and the run CLI commands."""
