"""The wire: what crosses process boundaries, one module per concept (``codec``, ``invoke``,
``executor``, ``jobs``)."""
