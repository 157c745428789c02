//! Point-to-point send and receive, chunked through the link's slots.

use crate::collectives::exchange::pieces;
use crate::collectives::pause::wait_on;
use crate::error::{Error, Result};
use crate::transport::Link;

/// Sends `data` to `dst`; returns when every chunk is posted (the data has been staged).
pub fn send(link: &mut dyn Link, dst: usize, data: &[u8]) -> Result<()> {
    let max = link.props().max_chunk;
    link.begin();
    for i in 0..pieces(data.len(), max) {
        let part = &data[(i * max).min(data.len())..((i + 1) * max).min(data.len())];
        while !link.try_post(dst, part)? {
            wait_on(link, dst)?;
        }
    }
    Ok(())
}

/// Receives exactly `data.len()` bytes from `src`.
pub fn recv(link: &mut dyn Link, src: usize, data: &mut [u8]) -> Result<()> {
    let max = link.props().max_chunk;
    let total = data.len();
    link.begin();
    for i in 0..pieces(total, max) {
        let part = &mut data[(i * max).min(total)..((i + 1) * max).min(total)];
        loop {
            let got = link.try_take_into(src, part).map_err(|e| match e {
                Error::InvalidArgument(why) => Error::InvalidArgument(format!(
                    "recv of {total} bytes from rank {src}: {why} (the sender's length differs)"
                )),
                e => e,
            })?;
            if got {
                break;
            }
            wait_on(link, src)?;
        }
    }
    Ok(())
}
