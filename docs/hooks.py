"""mkdocs hook: fill the reference pages' `<!-- generated: NAME -->` markers from the code."""
