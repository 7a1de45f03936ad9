//! REGION_READ and REGION_WRITE (single and multiple, posted or not).

use switchyard_proto::{
    Command, Records, Reply, Request, WriteMultiEntry, region_write_request_buffer,
};

use crate::error::unexpected;
use crate::{Client, ClientError, Result};

impl Client {
    /// REGION_READ into `buf`, split into chunks of the server's
    /// `max_data_xfer_size`.
    pub fn region_read(&mut self, region: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        let chunk = self.server_caps.max_data_xfer_size.max(1) as usize;
        let mut off = offset;
        for part in buf.chunks_mut(chunk) {
            let count = part.len() as u32;
            let (hdr, fds) = self.call(
                &Request::RegionRead {
                    offset: off,
                    region,
                    count,
                },
                &[],
            )?;
            match self.decode(&hdr, fds.len())? {
                Reply::RegionRead {
                    offset: o,
                    region: r,
                    data,
                } if o == off && r == region && data.len() == part.len() => {
                    part.copy_from_slice(data);
                }
                _ => return Err(unexpected("REGION_READ")),
            }
            off = off
                .checked_add(u64::from(count))
                .ok_or(ClientError::InvalidArgument("offset overflow"))?;
        }
        Ok(())
    }

    /// REGION_WRITE (waits for the reply), chunked like [`Client::region_read`].
    pub fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.region_write_inner(region, offset, data, false)
    }

    /// REGION_WRITE with `No_reply` (posted): returns once sent.
    pub fn region_write_posted(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.region_write_inner(region, offset, data, true)
    }

    fn region_write_inner(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
        posted: bool,
    ) -> Result<()> {
        let chunk = self.server_caps.max_data_xfer_size.max(1) as usize;
        let mut off = offset;
        for part in data.chunks(chunk) {
            let count = part.len() as u32;
            let id = self.alloc_id();
            region_write_request_buffer(&mut self.out, id, posted, off, region, count)
                .map_err(ClientError::Protocol)?
                .copy_from_slice(part);
            if posted {
                self.send_out(&[])?;
            } else {
                let (hdr, _) = self.transact(id, Command::RegionWrite, &[])?;
                self.expect_reply(&hdr, 0, |r| {
                    matches!(r, Reply::RegionWrite { offset: o, region: g, count: c } if *o == off && *g == region && *c == count)
                })?;
            }
            off = off
                .checked_add(u64::from(count))
                .ok_or(ClientError::InvalidArgument("offset overflow"))?;
        }
        Ok(())
    }

    /// REGION_WRITE_MULTI (waits for the reply); returns `wr_cnt`.
    pub fn region_write_multi(&mut self, entries: &[WriteMultiEntry]) -> Result<u64> {
        match self.request(
            &Request::RegionWriteMulti(Records::from_slice(entries)),
            &[],
        )? {
            (Reply::RegionWriteMulti { wr_cnt }, _) => Ok(wr_cnt),
            _ => Err(unexpected("REGION_WRITE_MULTI")),
        }
    }

    /// REGION_WRITE_MULTI with `No_reply` (as QEMU sends it).
    pub fn region_write_multi_posted(&mut self, entries: &[WriteMultiEntry]) -> Result<()> {
        let id = self.alloc_id();
        Request::RegionWriteMulti(Records::from_slice(entries))
            .encode(id, true, &mut self.out)
            .map_err(ClientError::Protocol)?;
        self.send_out(&[])
    }
}
