"""Throwaway real services (PostgreSQL, S3) that tests and benchmarks start on this machine."""
