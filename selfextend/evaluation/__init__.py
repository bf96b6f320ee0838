"""Evaluation: NLL and perplexity, sweeps, passkey retrieval, aggregation, plots, the corpus, results files.

Also data-parallel sweeps under torchrun.
"""
