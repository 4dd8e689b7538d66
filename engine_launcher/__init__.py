"""Engine launcher, vLLM plugin and engine simulator for cachehit-router."""
