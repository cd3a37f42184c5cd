"""[loop] The asyncio side of the engine: submit, stream, abort; output processing."""
