"""Mooncake as bsr meets it: launching the real services on loopback (`services`) and probing a running
deployment's health (`health`)."""
