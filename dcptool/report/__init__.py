"""Rendering: the text and JSON reports, the HTML page, the timeline model, the progress bar. The only package that
prints."""
