"""Imported by procspawn's fork server when a test asks it to preload this module."""

import os

IMPORTED_IN = os.getpid()
