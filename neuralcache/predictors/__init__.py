"""Predictors: each turns observed reads into a window of blocks it expects to be read soon."""
