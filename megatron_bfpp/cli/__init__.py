"""Thin command-line entry points; each turns flags into library calls and errors into one line."""
