//! Protocol constants (vfio-user spec, `linux/vfio.h`, libvfio-user and QEMU).
//!
//! Names follow the C headers so they can be grepped against the spec.

/// Size of the message header.
pub const HEADER_SIZE: usize = 16;

// ---- Header flags ----
/// Mask of the message-type bits in the header flags.
pub const VFIO_USER_F_TYPE_MASK: u32 = 0xf;
/// Message type: command.
pub const VFIO_USER_F_TYPE_COMMAND: u32 = 0x0;
/// Message type: reply.
pub const VFIO_USER_F_TYPE_REPLY: u32 = 0x1;
/// Header flag: the sender does not want a reply.
pub const VFIO_USER_F_NO_REPLY: u32 = 0x10;
/// Header flag: the reply reports an error (`error_no` holds the errno).
pub const VFIO_USER_F_ERROR: u32 = 0x20;
/// All defined header flag bits.
pub const VFIO_USER_F_ALL: u32 = VFIO_USER_F_TYPE_MASK | VFIO_USER_F_NO_REPLY | VFIO_USER_F_ERROR;

// ---- Command numbers ----
/// `VFIO_USER_VERSION`.
pub const VFIO_USER_VERSION: u16 = 1;
/// `VFIO_USER_DMA_MAP`.
pub const VFIO_USER_DMA_MAP: u16 = 2;
/// `VFIO_USER_DMA_UNMAP`.
pub const VFIO_USER_DMA_UNMAP: u16 = 3;
/// `VFIO_USER_DEVICE_GET_INFO`.
pub const VFIO_USER_DEVICE_GET_INFO: u16 = 4;
/// `VFIO_USER_DEVICE_GET_REGION_INFO`.
pub const VFIO_USER_DEVICE_GET_REGION_INFO: u16 = 5;
/// `VFIO_USER_DEVICE_GET_REGION_IO_FDS`.
pub const VFIO_USER_DEVICE_GET_REGION_IO_FDS: u16 = 6;
/// `VFIO_USER_DEVICE_GET_IRQ_INFO`.
pub const VFIO_USER_DEVICE_GET_IRQ_INFO: u16 = 7;
/// `VFIO_USER_DEVICE_SET_IRQS`.
pub const VFIO_USER_DEVICE_SET_IRQS: u16 = 8;
/// `VFIO_USER_REGION_READ`.
pub const VFIO_USER_REGION_READ: u16 = 9;
/// `VFIO_USER_REGION_WRITE`.
pub const VFIO_USER_REGION_WRITE: u16 = 10;
/// `VFIO_USER_DMA_READ` (server to client).
pub const VFIO_USER_DMA_READ: u16 = 11;
/// `VFIO_USER_DMA_WRITE` (server to client).
pub const VFIO_USER_DMA_WRITE: u16 = 12;
/// `VFIO_USER_DEVICE_RESET`.
pub const VFIO_USER_DEVICE_RESET: u16 = 13;
/// `VFIO_USER_DIRTY_PAGES` (legacy migration v1; removed from the spec).
pub const VFIO_USER_DIRTY_PAGES: u16 = 14;
/// `VFIO_USER_REGION_WRITE_MULTI`.
pub const VFIO_USER_REGION_WRITE_MULTI: u16 = 15;
/// `VFIO_USER_DEVICE_FEATURE`.
pub const VFIO_USER_DEVICE_FEATURE: u16 = 16;
/// `VFIO_USER_MIG_DATA_READ`.
pub const VFIO_USER_MIG_DATA_READ: u16 = 17;
/// `VFIO_USER_MIG_DATA_WRITE`.
pub const VFIO_USER_MIG_DATA_WRITE: u16 = 18;
/// `VFIO_USER_GET_PRECOPY_INFO` (in-flight QEMU work; not in libvfio-user).
pub const VFIO_USER_GET_PRECOPY_INFO: u16 = 19;

// ---- Versions and capability defaults ----
/// The only protocol major version.
pub const VFIO_USER_MAJOR: u16 = 0;
/// The minor version this codec answers with (QEMU rejects a higher one).
pub const VFIO_USER_MINOR: u16 = 0;
/// Default `max_msg_fds` when the peer omits it (spec).
pub const DEFAULT_MAX_MSG_FDS: u32 = 1;
/// `VFIO_USER_DEFAULT_MAX_DATA_XFER_SIZE`.
pub const DEFAULT_MAX_DATA_XFER_SIZE: u32 = 1 << 20;
/// Default `max_dma_maps` (spec).
pub const DEFAULT_MAX_DMA_MAPS: u32 = 65535;
/// Default `pgsizes`: 4 KiB only.
pub const DEFAULT_PGSIZES: u64 = 4096;
/// Default legacy `migration.max_bitmap_size` (QEMU `VFIO_USER_DEF_MAX_BITMAP`).
pub const DEFAULT_MAX_BITMAP_SIZE: u64 = 256 << 20;
/// Largest `max_msg_fds` accepted from a peer (libvfio-user client limit).
pub const MAX_MSG_FDS_LIMIT: u32 = 1024;
/// Largest `max_data_xfer_size` accepted from a peer (QEMU limit, 64 MiB).
pub const MAX_DATA_XFER_SIZE_LIMIT: u32 = 64 << 20;
/// Largest `max_dma_maps` accepted from a peer (QEMU limit).
pub const MAX_DMA_MAPS_LIMIT: u32 = 65535;
/// Largest legacy `migration.max_bitmap_size` accepted (QEMU limit).
pub const MAX_BITMAP_SIZE_LIMIT: u64 = 256 << 20;
/// Largest whole message accepted by [`crate::Header::body_len`]:
/// the largest `max_data_xfer_size` plus generous room for fixed parts.
pub const MAX_MSG_SIZE: u32 = MAX_DATA_XFER_SIZE_LIMIT + (64 << 10);
/// QEMU's `VFIO_USER_MULTI_MAX`: the most entries in one WRITE_MULTI.
pub const VFIO_USER_MULTI_MAX: u32 = 200;
/// QEMU's `VFIO_USER_MULTI_DATA`: the most bytes one WRITE_MULTI entry writes.
pub const VFIO_USER_MULTI_DATA: u32 = 8;
/// QEMU refuses devices with more regions than this.
pub const QEMU_MAX_REGIONS: u32 = 100;
/// QEMU refuses devices with more IRQ indexes than this.
pub const QEMU_MAX_IRQS: u32 = 50;
/// QEMU's default number of fds per message when the server omits `max_msg_fds`.
pub const QEMU_DEFAULT_MAX_FDS: u32 = 8;
/// QEMU's largest `max_msg_fds` accepted from a server (`VFIO_USER_MAX_MAX_FDS`).
pub const QEMU_MAX_FDS: u32 = 16;
/// QEMU's outgoing-queue high-water mark at which it starts coalescing posted writes into WRITE_MULTI.
pub const VFIO_USER_OUT_HIGH: u32 = 1024;
/// QEMU's outgoing-queue low-water mark at which it stops coalescing.
pub const VFIO_USER_OUT_LOW: u32 = 128;
/// libvfio-user's `SERVER_MAX_FDS` (advertised `max_msg_fds`).
pub const LIBVFIO_USER_SERVER_MAX_FDS: u32 = 8;
/// libvfio-user's `LIBVFIO_USER_MAX_DMA_REGIONS` default.
pub const LIBVFIO_USER_MAX_DMA_REGIONS: u32 = 1_000_000;
/// libvfio-user's largest DMA region (8 TiB).
pub const LIBVFIO_USER_MAX_DMA_SIZE: u64 = 8 << 40;
/// libvfio-user's largest DMA_UNMAP argsz with a dirty bitmap.
pub const MAX_DIRTY_BITMAP_ARGSZ: u64 = 1 << 20;

// ---- Device info ----
/// `VFIO_DEVICE_FLAGS_RESET`.
pub const VFIO_DEVICE_FLAGS_RESET: u32 = 1 << 0;
/// `VFIO_DEVICE_FLAGS_PCI`.
pub const VFIO_DEVICE_FLAGS_PCI: u32 = 1 << 1;

// ---- Region info ----
/// `VFIO_REGION_INFO_FLAG_READ`.
pub const VFIO_REGION_INFO_FLAG_READ: u32 = 1 << 0;
/// `VFIO_REGION_INFO_FLAG_WRITE`.
pub const VFIO_REGION_INFO_FLAG_WRITE: u32 = 1 << 1;
/// `VFIO_REGION_INFO_FLAG_MMAP`.
pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 1 << 2;
/// `VFIO_REGION_INFO_FLAG_CAPS`.
pub const VFIO_REGION_INFO_FLAG_CAPS: u32 = 1 << 3;
/// `VFIO_REGION_INFO_CAP_SPARSE_MMAP`.
pub const VFIO_REGION_INFO_CAP_SPARSE_MMAP: u16 = 1;
/// `VFIO_REGION_INFO_CAP_TYPE`.
pub const VFIO_REGION_INFO_CAP_TYPE: u16 = 2;
/// `VFIO_REGION_INFO_CAP_MSIX_MAPPABLE`.
pub const VFIO_REGION_INFO_CAP_MSIX_MAPPABLE: u16 = 3;
/// `VFIO_REGION_INFO_CAP_NVLINK2_SSATGT`.
pub const VFIO_REGION_INFO_CAP_NVLINK2_SSATGT: u16 = 4;
/// `VFIO_REGION_INFO_CAP_NVLINK2_LNKSPD`.
pub const VFIO_REGION_INFO_CAP_NVLINK2_LNKSPD: u16 = 5;
/// In-flight `VFIO_REGION_INFO_CAP_SPARSE_MMAP_FDS` as in QEMU's `protocol.h` (the spec text says 0x8001).
pub const VFIO_REGION_INFO_CAP_SPARSE_MMAP_FDS: u16 = 16;
/// The spec text's value for the sparse-mmap-fds capability (see §1.20 #4).
pub const VFIO_REGION_INFO_CAP_SPARSE_MMAP_FDS_SPEC: u16 = 0x8001;
/// Size of `struct vfio_region_info`.
pub const REGION_INFO_SIZE: usize = 32;

// ---- PCI region indexes ----
/// `VFIO_PCI_BAR0_REGION_INDEX`.
pub const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
/// `VFIO_PCI_BAR1_REGION_INDEX`.
pub const VFIO_PCI_BAR1_REGION_INDEX: u32 = 1;
/// `VFIO_PCI_BAR2_REGION_INDEX`.
pub const VFIO_PCI_BAR2_REGION_INDEX: u32 = 2;
/// `VFIO_PCI_BAR3_REGION_INDEX`.
pub const VFIO_PCI_BAR3_REGION_INDEX: u32 = 3;
/// `VFIO_PCI_BAR4_REGION_INDEX`.
pub const VFIO_PCI_BAR4_REGION_INDEX: u32 = 4;
/// `VFIO_PCI_BAR5_REGION_INDEX`.
pub const VFIO_PCI_BAR5_REGION_INDEX: u32 = 5;
/// `VFIO_PCI_ROM_REGION_INDEX`.
pub const VFIO_PCI_ROM_REGION_INDEX: u32 = 6;
/// `VFIO_PCI_CONFIG_REGION_INDEX`.
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
/// `VFIO_PCI_VGA_REGION_INDEX`.
pub const VFIO_PCI_VGA_REGION_INDEX: u32 = 8;
/// `VFIO_PCI_NUM_REGIONS`.
pub const VFIO_PCI_NUM_REGIONS: u32 = 9;

// ---- PCI IRQ indexes ----
/// `VFIO_PCI_INTX_IRQ_INDEX`.
pub const VFIO_PCI_INTX_IRQ_INDEX: u32 = 0;
/// `VFIO_PCI_MSI_IRQ_INDEX`.
pub const VFIO_PCI_MSI_IRQ_INDEX: u32 = 1;
/// `VFIO_PCI_MSIX_IRQ_INDEX`.
pub const VFIO_PCI_MSIX_IRQ_INDEX: u32 = 2;
/// `VFIO_PCI_ERR_IRQ_INDEX`.
pub const VFIO_PCI_ERR_IRQ_INDEX: u32 = 3;
/// `VFIO_PCI_REQ_IRQ_INDEX`.
pub const VFIO_PCI_REQ_IRQ_INDEX: u32 = 4;
/// `VFIO_PCI_NUM_IRQS`.
pub const VFIO_PCI_NUM_IRQS: u32 = 5;

// ---- IRQ info ----
/// `VFIO_IRQ_INFO_EVENTFD`.
pub const VFIO_IRQ_INFO_EVENTFD: u32 = 1 << 0;
/// `VFIO_IRQ_INFO_MASKABLE`.
pub const VFIO_IRQ_INFO_MASKABLE: u32 = 1 << 1;
/// `VFIO_IRQ_INFO_AUTOMASKED`.
pub const VFIO_IRQ_INFO_AUTOMASKED: u32 = 1 << 2;
/// `VFIO_IRQ_INFO_NORESIZE`.
pub const VFIO_IRQ_INFO_NORESIZE: u32 = 1 << 3;

// ---- SET_IRQS ----
/// `VFIO_IRQ_SET_DATA_NONE`.
pub const VFIO_IRQ_SET_DATA_NONE: u32 = 1 << 0;
/// `VFIO_IRQ_SET_DATA_BOOL`.
pub const VFIO_IRQ_SET_DATA_BOOL: u32 = 1 << 1;
/// `VFIO_IRQ_SET_DATA_EVENTFD`.
pub const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
/// `VFIO_IRQ_SET_DATA_TYPE_MASK`.
pub const VFIO_IRQ_SET_DATA_TYPE_MASK: u32 = 0x7;
/// `VFIO_IRQ_SET_ACTION_MASK`.
pub const VFIO_IRQ_SET_ACTION_MASK: u32 = 1 << 3;
/// `VFIO_IRQ_SET_ACTION_UNMASK`.
pub const VFIO_IRQ_SET_ACTION_UNMASK: u32 = 1 << 4;
/// `VFIO_IRQ_SET_ACTION_TRIGGER`.
pub const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;
/// `VFIO_IRQ_SET_ACTION_TYPE_MASK`.
pub const VFIO_IRQ_SET_ACTION_TYPE_MASK: u32 = 0x38;

// ---- DMA map/unmap ----
/// `VFIO_USER_F_DMA_REGION_READ`.
pub const VFIO_USER_F_DMA_REGION_READ: u32 = 1 << 0;
/// `VFIO_USER_F_DMA_REGION_WRITE`.
pub const VFIO_USER_F_DMA_REGION_WRITE: u32 = 1 << 1;
/// `VFIO_USER_F_DMA_REGION_MMAP` (access mode: mmap the fd; new).
pub const VFIO_USER_F_DMA_REGION_MMAP: u32 = 1 << 2;
/// `VFIO_USER_F_DMA_REGION_FILE_IO` (access mode: pread/pwrite on the fd; new).
pub const VFIO_USER_F_DMA_REGION_FILE_IO: u32 = 1 << 3;
/// All defined DMA_MAP flags.
pub const VFIO_USER_F_DMA_REGION_ALL: u32 = VFIO_USER_F_DMA_REGION_READ
    | VFIO_USER_F_DMA_REGION_WRITE
    | VFIO_USER_F_DMA_REGION_MMAP
    | VFIO_USER_F_DMA_REGION_FILE_IO;
/// `VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP`.
pub const VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP: u32 = 1 << 0;
/// `VFIO_DMA_UNMAP_FLAG_ALL`.
pub const VFIO_DMA_UNMAP_FLAG_ALL: u32 = 1 << 1;

// ---- GET_REGION_IO_FDS ----
/// `VFIO_USER_IO_FD_TYPE_IOEVENTFD`.
pub const VFIO_USER_IO_FD_TYPE_IOEVENTFD: u32 = 0;
/// `VFIO_USER_IO_FD_TYPE_IOREGIONFD`.
pub const VFIO_USER_IO_FD_TYPE_IOREGIONFD: u32 = 1;
/// `VFIO_USER_IO_FD_TYPE_IOEVENTFD_SHADOW` (libvfio-user only).
pub const VFIO_USER_IO_FD_TYPE_IOEVENTFD_SHADOW: u32 = 2;
/// `KVM_IOEVENTFD_FLAG_DATAMATCH`.
pub const KVM_IOEVENTFD_FLAG_DATAMATCH: u32 = 1 << 0;
/// `KVM_IOEVENTFD_FLAG_PIO`.
pub const KVM_IOEVENTFD_FLAG_PIO: u32 = 1 << 1;
/// `KVM_IOEVENTFD_FLAG_DEASSIGN`.
pub const KVM_IOEVENTFD_FLAG_DEASSIGN: u32 = 1 << 2;
/// `KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY`.
pub const KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY: u32 = 1 << 3;
/// `KVM_IOREGION_PIO` (ioregionfd was never merged into Linux; proposed value).
pub const KVM_IOREGION_PIO: u32 = 1 << 0;
/// `KVM_IOREGION_POSTED_WRITES` (ioregionfd was never merged; proposed value).
pub const KVM_IOREGION_POSTED_WRITES: u32 = 1 << 1;

// ---- DEVICE_FEATURE ----
/// `VFIO_DEVICE_FEATURE_MASK` (feature index bits).
pub const VFIO_DEVICE_FEATURE_MASK: u32 = 0xffff;
/// `VFIO_DEVICE_FEATURE_GET`.
pub const VFIO_DEVICE_FEATURE_GET: u32 = 1 << 16;
/// `VFIO_DEVICE_FEATURE_SET`.
pub const VFIO_DEVICE_FEATURE_SET: u32 = 1 << 17;
/// `VFIO_DEVICE_FEATURE_PROBE`.
pub const VFIO_DEVICE_FEATURE_PROBE: u32 = 1 << 18;
/// All defined DEVICE_FEATURE flag bits.
pub const VFIO_DEVICE_FEATURE_ALL: u32 = VFIO_DEVICE_FEATURE_MASK
    | VFIO_DEVICE_FEATURE_GET
    | VFIO_DEVICE_FEATURE_SET
    | VFIO_DEVICE_FEATURE_PROBE;
/// `VFIO_DEVICE_FEATURE_PCI_VF_TOKEN` (kernel only).
pub const VFIO_DEVICE_FEATURE_PCI_VF_TOKEN: u16 = 0;
/// `VFIO_DEVICE_FEATURE_MIGRATION`.
pub const VFIO_DEVICE_FEATURE_MIGRATION: u16 = 1;
/// `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`.
pub const VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE: u16 = 2;
/// `VFIO_DEVICE_FEATURE_LOW_POWER_ENTRY` (kernel only).
pub const VFIO_DEVICE_FEATURE_LOW_POWER_ENTRY: u16 = 3;
/// `VFIO_DEVICE_FEATURE_LOW_POWER_ENTRY_WITH_WAKEUP` (kernel only).
pub const VFIO_DEVICE_FEATURE_LOW_POWER_ENTRY_WITH_WAKEUP: u16 = 4;
/// `VFIO_DEVICE_FEATURE_LOW_POWER_EXIT` (kernel only).
pub const VFIO_DEVICE_FEATURE_LOW_POWER_EXIT: u16 = 5;
/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_START`.
pub const VFIO_DEVICE_FEATURE_DMA_LOGGING_START: u16 = 6;
/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP`.
pub const VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP: u16 = 7;
/// `VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT`.
pub const VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT: u16 = 8;
/// `VFIO_DEVICE_FEATURE_MIG_DATA_SIZE` (kernel only).
pub const VFIO_DEVICE_FEATURE_MIG_DATA_SIZE: u16 = 9;
/// `VFIO_DEVICE_FEATURE_BUS_MASTER` (kernel only).
pub const VFIO_DEVICE_FEATURE_BUS_MASTER: u16 = 10;
/// `VFIO_DEVICE_FEATURE_DMA_BUF` (kernel only).
pub const VFIO_DEVICE_FEATURE_DMA_BUF: u16 = 11;
/// `VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS`, a vfio-user extension of Switchyard and
/// its QEMU patch (`vmm-integration/qemu/patches/0009`): SET with a 64-bit little-endian
/// mask of region indexes whose sparse mmap areas the client migrates itself, as RAM. The
/// kernel allocates feature indexes upward from 0 (11 is its highest); this one is from the
/// top of the 16-bit space so that no kernel feature can take it.
pub const VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS: u16 = 0xff00;

// ---- Migration ----
/// `VFIO_MIGRATION_STOP_COPY`.
pub const VFIO_MIGRATION_STOP_COPY: u64 = 1 << 0;
/// `VFIO_MIGRATION_P2P`.
pub const VFIO_MIGRATION_P2P: u64 = 1 << 1;
/// `VFIO_MIGRATION_PRE_COPY`.
pub const VFIO_MIGRATION_PRE_COPY: u64 = 1 << 2;
/// `VFIO_DEVICE_STATE_ERROR`.
pub const VFIO_DEVICE_STATE_ERROR: u32 = 0;
/// `VFIO_DEVICE_STATE_STOP`.
pub const VFIO_DEVICE_STATE_STOP: u32 = 1;
/// `VFIO_DEVICE_STATE_RUNNING`.
pub const VFIO_DEVICE_STATE_RUNNING: u32 = 2;
/// `VFIO_DEVICE_STATE_STOP_COPY`.
pub const VFIO_DEVICE_STATE_STOP_COPY: u32 = 3;
/// `VFIO_DEVICE_STATE_RESUMING`.
pub const VFIO_DEVICE_STATE_RESUMING: u32 = 4;
/// `VFIO_DEVICE_STATE_RUNNING_P2P`.
pub const VFIO_DEVICE_STATE_RUNNING_P2P: u32 = 5;
/// `VFIO_DEVICE_STATE_PRE_COPY`.
pub const VFIO_DEVICE_STATE_PRE_COPY: u32 = 6;
/// `VFIO_DEVICE_STATE_PRE_COPY_P2P`.
pub const VFIO_DEVICE_STATE_PRE_COPY_P2P: u32 = 7;

// ---- Legacy DIRTY_PAGES (v1) flags, for recognising old peers ----
/// `VFIO_IOMMU_DIRTY_PAGES_FLAG_START`.
pub const VFIO_IOMMU_DIRTY_PAGES_FLAG_START: u32 = 1 << 0;
/// `VFIO_IOMMU_DIRTY_PAGES_FLAG_STOP`.
pub const VFIO_IOMMU_DIRTY_PAGES_FLAG_STOP: u32 = 1 << 1;
/// `VFIO_IOMMU_DIRTY_PAGES_FLAG_GET_BITMAP`.
pub const VFIO_IOMMU_DIRTY_PAGES_FLAG_GET_BITMAP: u32 = 1 << 2;
