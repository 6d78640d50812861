"""The fake runtime's image service: pull, list, status, remove, filesystem info (a part of
:class:`krproxy.fakes.containerd.state.RuntimeState`, over its
:class:`~krproxy.fakes.containerd._tables.Tables`)."""

from __future__ import annotations

import attrs

from krproxy.fakes.containerd._tables import Tables
from krproxy.fakes.containerd.records import IMAGE_FS_MOUNTPOINT, Code, CriError
from krproxy.fakes.containerd.settings import Settings
from krproxy.proto.runtime import v1 as cri


@attrs.define(eq=False)
class ImageCalls:
    """The CRI image service on *tables*, its clock from *settings*."""

    tables: Tables
    settings: Settings

    def pull_image(self, request: cri.PullImageRequest) -> cri.PullImageResponse:
        """Record the image (no network); answers its ``sha256:`` ID like containerd."""
        name = request.image.image if request.image else ""
        if not name:
            raise CriError(Code.INVALID_ARGUMENT, "image reference must not be empty")
        return cri.PullImageResponse(image_ref=self.tables.record_image(name).id)

    def list_images(self, request: cri.ListImagesRequest) -> cri.ListImagesResponse:
        """All pulled images, or the one the filter names."""
        name = request.filter.image.image if request.filter and request.filter.image else ""
        if name:
            image = self.tables.resolve_image(name)
            images = [image] if image is not None else []
        else:
            images = self.tables.unordered(self.tables.images.values())
        return cri.ListImagesResponse(images=[self.tables.image_message(i) for i in images])

    def image_status(self, request: cri.ImageStatusRequest) -> cri.ImageStatusResponse:
        """The image, or an empty response (not an error) when it is not present."""
        image = self.tables.resolve_image(request.image.image if request.image else "")
        return cri.ImageStatusResponse(image=self.tables.image_message(image) if image is not None else None)

    def remove_image(self, request: cri.RemoveImageRequest) -> cri.RemoveImageResponse:
        """Forget the image; removing a missing image succeeds."""
        image = self.tables.resolve_image(request.image.image if request.image else "")
        if image is not None:
            del self.tables.images[image.id]
        return cri.RemoveImageResponse()

    def image_fs_info(self, request: cri.ImageFsInfoRequest) -> cri.ImageFsInfoResponse:
        """One image filesystem whose usage is the sum of the pulled images' sizes."""
        return cri.ImageFsInfoResponse(
            image_filesystems=[
                cri.FilesystemUsage(
                    timestamp=self.settings.clock(),
                    fs_id=cri.FilesystemIdentifier(mountpoint=IMAGE_FS_MOUNTPOINT),
                    used_bytes=cri.UInt64Value(value=sum(i.size for i in self.tables.images.values())),
                    inodes_used=cri.UInt64Value(value=100 * len(self.tables.images)),
                )
            ]
        )
