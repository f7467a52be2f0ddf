"""Server tests: the real daemon in a subprocess on a free loopback port."""
