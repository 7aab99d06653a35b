"""Weights out of the store: a step's consolidated weights in memory, or as a model folder."""
