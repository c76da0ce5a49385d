"""A stand-in for sglang-router (not installed on CPU boxes), for the launcher's readiness test."""
