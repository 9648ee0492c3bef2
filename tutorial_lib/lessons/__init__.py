"""One module per lesson, named after the lesson's notebook: its rank functions and experiments.

Functions a lesson runs on several ranks must live in an importable module (a function defined
in a notebook cannot be found by a spawned process). Nothing in the library imports this package.
"""
