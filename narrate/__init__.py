"""The composition root: the ``narrate`` command, the supervisor of its process trees and the
embedded Valkey. Everything else is imported from here, never the other way round."""
