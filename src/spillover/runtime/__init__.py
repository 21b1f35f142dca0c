"""The gateway's asyncio side: worker channel, supervisor, scheduler loop."""
