"""Benchmarks: speed and memory side by side, and llama.cpp as a yardstick."""
