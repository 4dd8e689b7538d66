# A package so that the engines of conftest.py (scope="package") stop when this directory's
# tests end, instead of running idle through every later suite.
