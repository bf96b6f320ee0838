"""The ``selfextend`` command line: thin click commands over the library."""
