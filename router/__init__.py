"""cachehit-router: the daemon."""
