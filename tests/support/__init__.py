"""Helpers shared by the tests: reference implementations, file writers, checks run in subprocesses."""
