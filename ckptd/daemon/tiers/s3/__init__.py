"""The bucket behind the local root: client, credentials, uploads, staging."""
