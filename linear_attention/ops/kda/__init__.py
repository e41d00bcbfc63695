"""Kimi Delta Attention (arXiv 2510.26692): one API, three backends."""
