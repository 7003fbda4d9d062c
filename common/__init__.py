"""Plumbing that builder and client both use: progress display, atomic files, log set-up, str enums
(`Choice`) and Triton's datatype table. It imports neither builder nor client."""
