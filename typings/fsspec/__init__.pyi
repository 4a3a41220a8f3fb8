from fsspec.spec import AbstractFileSystem as AbstractFileSystem

__version__: str
